"""What the async and the sync coordinator share: the SQL, the settings, the
claim's data, and the decorator's argument handling.  Nothing here talks to
the server."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import (Any, Callable, Coroutine, Dict, Iterator, Optional, ParamSpec, Protocol, Sequence, Tuple,
                    TypeVar, Union)

import psycopg
from psycopg.types.json import Jsonb

from .errors import translate
from .fingerprint import fingerprint

# Every parameter is cast: psycopg sends str as "unknown" and some values in
# binary, and idem_fingerprint(VARIADIC "any") or an overloaded function
# would otherwise fail with 42P18 (could not determine data type).
_BEGIN = ("SELECT c.status, c.token, c.response"
          "  FROM idem_begin(%(operation)s::text, %(key)s::text, %(fingerprint)s::bytea,"
          " in_flight => %(in_flight)s::text, lease => %(lease)s::interval,"
          " ttl => %(ttl)s::interval{extra}) AS c")
# the response is read back as stored: a replay gets exactly this (jsonb
# orders keys its own way)
FINISH_SQL = ("SELECT idem_finish(%(operation)s::text, %(key)s::text, %(token)s::bigint,"
              " %(response)s::jsonb), %(response)s::jsonb")
ABORT_SQL = "SELECT idem_abort(%(operation)s::text, %(key)s::text, %(token)s::bigint)"
CHECKPOINT_SQL = ("SELECT idem_checkpoint(%(operation)s::text, %(key)s::text,"
                  " %(token)s::bigint, %(state)s::jsonb)")
# the record of a key, as the calling role sees it: one row, NULLs for none
INSPECT_SQL = ("SELECT i.state, i.token, i.response FROM (SELECT) AS one"
               " LEFT JOIN idem_inspect(%(operation)s::text, %(key)s::text) AS i ON true")
# 1.4 or later: idem_checkpoint exists
HAS_1_4_SQL = "SELECT to_regprocedure('idem_checkpoint(text,text,bigint,jsonb)') IS NOT NULL"

SERIALIZATION_RETRIES = 3


#: what a coordinator takes for ``lease``, ``ttl`` and ``remember``: a
#: ``timedelta``, seconds (``int`` or ``float``), an interval's text
#: (``"30 s"``), or ``None`` (the server's setting)
Duration = Union[timedelta, int, float, str, None]


def duration(name: str, value: Duration) -> Union[timedelta, str, None]:
    """``value`` as idem_begin's interval argument: seconds become a
    ``timedelta``; the server checks the value itself (README, "API
    reference"), so a bad one fails there with 22023."""
    if value is None or isinstance(value, (timedelta, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
        return timedelta(seconds=value)
    raise TypeError(f"{name} must be a timedelta, a number of seconds, an interval's text "
                    f"or None, not {type(value).__name__}")


def policy(name: str, value: Optional[str], allowed: Tuple[str, ...], *, optional: bool = False) -> Optional[str]:
    """A policy argument in any case, as the server takes it, sent in lower
    case; ``None`` only if ``optional`` (the server's setting)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or value.lower() not in allowed:
        choices = " or ".join(f'"{a}"' for a in allowed) + (" (any case), or None" if optional else " (any case)")
        raise ValueError(f"{name} must be {choices}, not {value!r}")
    return value.lower()


@dataclass(frozen=True)
class Settings:
    """The idem_begin arguments a coordinator passes with every claim: only
    those the caller gave; ``None`` is sent as NULL, so that the server's
    settings (``ALTER ROLE ... SET idempotency.ttl``) apply."""

    in_flight: str
    lease: Union[timedelta, str, None]
    ttl: Union[timedelta, str, None]
    takeover: Optional[str]
    remember: Union[timedelta, str, None]

    @classmethod
    def make(cls, in_flight: str, lease: Duration, ttl: Duration, takeover: Optional[str],
             remember: Duration) -> "Settings":
        return cls(policy("in_flight", in_flight, ("wait", "raise")) or "wait",
                   duration("lease", lease), duration("ttl", ttl),
                   policy("takeover", takeover, ("lease", "session"), optional=True),
                   duration("remember", remember))

    def begin_sql(self) -> str:
        """idem_begin's statement; the 1.4 arguments only when set, so that a
        1.3 server serves a coordinator that does not use them."""
        extra = ""
        if self.takeover is not None:
            extra += ", takeover => %(takeover)s::text"
        if self.remember is not None:
            extra += ", remember => %(remember)s::interval"
        return _BEGIN.format(extra=extra)

    def begin_params(self, operation: str, key: str, fp: Optional[bytes]) -> Dict[str, Any]:
        return {"operation": operation, "key": key, "fingerprint": fp,
                "in_flight": self.in_flight, "lease": self.lease, "ttl": self.ttl,
                "takeover": self.takeover, "remember": self.remember}


@contextlib.contextmanager
def db_errors() -> Iterator[None]:
    """Raise the extension's SQLSTATEs as :class:`IdempotencyError` subclasses."""
    try:
        yield
    except psycopg.Error as err:
        translated = translate(err)
        if translated is None:
            raise
        raise translated from err


class ClaimState:
    """What idem_begin answered, and what became of the claim since.

    ``status``: ``'new'`` (you hold the key), ``'replay'`` (``response`` is the
    stored response), ``'recover'`` (1.4: you hold a taken-over key;
    ``response`` is its last checkpoint's state).  ``token``: the fencing
    token while you hold the key, else ``None``.
    """

    def __init__(self, operation: str, key: str, row: Optional[Tuple[Any, Any, Any]] = None) -> None:
        self.operation = operation
        self.key = key
        self.status: Optional[str] = None
        self.token: Optional[int] = None
        self.response: Any = None
        self.finished = False
        #: whether the claim has a checkpoint: this attempt made one, or it
        #: took over a claim that had one (status 'recover')
        self.checkpointed = False
        if row is not None:
            self._set(row)

    def _set(self, row: Tuple[Any, ...]) -> None:
        self.status, self.token, self.response = row[0], row[1], row[2]
        self.checkpointed = self.status == "recover"

    def _params(self, **extra: Any) -> Dict[str, Any]:
        if self.token is None:
            raise RuntimeError(f"no claim held on key {self.key!r} (status {self.status!r})")
        return {"operation": self.operation, "key": self.key, "token": self.token, **extra}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.operation!r} {self.key!r} {self.status} token={self.token}>"


#: the claim of the innermost decorated call running in this context
_current: ContextVar[Optional[ClaimState]] = ContextVar("idempotency_pg_current_claim", default=None)


def current_claim() -> Any:
    """The claim of the decorated call running in this context (asyncio task
    or thread): an :class:`~idempotency_pg.AsyncClaim` or a
    :class:`~idempotency_pg.Claim`, e.g. for ``await
    current_claim().checkpoint(state)``; ``None`` outside a decorated call."""
    return _current.get()


@dataclass(frozen=True)
class Outcome:
    """What a decorated call returned: ``value``, and ``replayed`` -- true when
    the value is a stored response and the function did not run in this call."""

    value: Any
    replayed: bool


def to_json(result: Any) -> Jsonb:
    """A function's result as a jsonb parameter (pydantic models dumped to
    JSON types).  It is encoded here, before any statement is sent: a value
    JSON cannot encode (a ``datetime``, ``NaN``) raises ``TypeError`` or
    ``ValueError`` with nothing sent."""
    if hasattr(result, "model_dump"):          # pydantic 2
        result = result.model_dump(mode="json")
    elif hasattr(result, "json") and hasattr(result, "parse_obj"):   # pydantic 1
        result = json.loads(result.json())
    text = json.dumps(result, allow_nan=False)
    return Jsonb(result, dumps=lambda _: text)


def unstored_state(err: BaseException) -> Dict[str, Any]:
    """The checkpoint state of a claim whose function ran and whose result
    could not be stored (python/README.md, "When the result cannot be
    stored"): what the retry gets with status 'recover'."""
    return {"response_not_stored": {"error": f"{type(err).__name__}: {err}"[:1000],
                                    "sqlstate": error_sqlstate(err)}}


def error_sqlstate(err: BaseException) -> Optional[str]:
    """The SQLSTATE of a psycopg or idempotency_pg error, else ``None``."""
    return getattr(err, "sqlstate", None)


def error_detail(err: BaseException) -> Optional[str]:
    """The server's DETAIL of a psycopg or idempotency_pg error, else ``None``."""
    if isinstance(err, psycopg.Error):
        return err.diag.message_detail
    return getattr(err, "detail", None)


def lost_connection(conn: Any, err: BaseException) -> bool:
    """Did ``err`` come from losing ``conn`` (the server ended the session,
    the network failed)?  Then a statement may be sent again on another
    connection."""
    return isinstance(err, psycopg.OperationalError) and (conn.closed or conn.broken)


P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class IdempotentFunction(Protocol[P, R_co]):
    """What ``Coordinator.idempotent`` makes of a function: called as the
    function is, and ``outcome(...)`` -- the same call, returning an
    :class:`Outcome`."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome: ...


class AsyncIdempotentFunction(Protocol[P, R_co]):
    """What ``AsyncCoordinator.idempotent`` makes of an ``async def``:
    awaited as the function is, and ``await outcome(...)`` -- the same
    call, returning an :class:`Outcome`."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, Outcome]: ...


def from_json(value: Any, result_type: Optional[type]) -> Any:
    """A stored response as the caller's result: ``result_type`` (a pydantic
    model) validated from it, or the JSON value as psycopg loads it."""
    if result_type is None:
        return value
    if hasattr(result_type, "model_validate"):
        return result_type.model_validate(value)
    return result_type.parse_obj(value)  # type: ignore[attr-defined]


class CallSpec:
    """How a decorated function's call maps to a key and a fingerprint."""

    def __init__(self, func: Callable[..., Any], fingerprint_params: Sequence[str]) -> None:
        self.signature = inspect.signature(func)
        params = self.signature.parameters
        if "idempotency_key" not in params:
            raise TypeError(f"{func.__qualname__} must take an idempotency_key= argument")
        for name in fingerprint_params:
            if name not in params:
                raise TypeError(f"fingerprint parameter {name!r} is not a parameter of {func.__qualname__}")
        self.fingerprint_params = tuple(fingerprint_params)

    def key_and_fingerprint(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Optional[str], bytes]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = bound.arguments["idempotency_key"]
        if key is None:
            return None, b""
        return key, fingerprint(*(bound.arguments[n] for n in self.fingerprint_params))


def serialization_retry(err: psycopg.Error, attempt: int) -> bool:
    """Retry idem_begin after 40001 (README, "Errors and HTTP": the retry replays)?"""
    return err.sqlstate == "40001" and attempt < SERIALIZATION_RETRIES
