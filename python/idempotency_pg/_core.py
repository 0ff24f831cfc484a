"""What the async and the sync coordinator share: the SQL, the settings, the
claim's data, and the decorator's argument handling.  Nothing here talks to
the server."""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
import typing
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Concatenate, LiteralString, ParamSpec, Protocol, TypeVar, cast, overload

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import PoolTimeout

from . import encoding
from .errors import (ExtensionVersionError, InProgressError, KeyReuseError, ResponseExpiredError,
                     ResponseNotStoredError, translate)
from .fingerprint import fingerprint

log = logging.getLogger("idempotency_pg")

# Every parameter is cast: psycopg sends str as "unknown" and some values in
# binary, and idem_fingerprint(VARIADIC "any") or an overloaded function
# would otherwise fail with 42P18 (could not determine data type).
_BEGIN = ("SELECT c.status, c.token, c.response{checkpoint}"
          "  FROM idem_begin(%(operation)s::text, %(key)s::text, %(fingerprint)s::bytea,"
          " in_flight => %(in_flight)s::text, lease => %(lease)s::interval,"
          " ttl => %(ttl)s::interval{extra}) AS c")
# With a checkpoint (extension 1.4), the claim's own statement records it on a
# new claim: one round trip, and no moment when the claim is pending without it
_BEGIN_CHECKPOINT = (", CASE WHEN c.status = 'new' THEN idem_checkpoint(%(operation)s::text, %(key)s::text,"
                     " c.token, %(checkpoint)s::jsonb) END")
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
Duration = timedelta | int | float | str | None


def duration(name: str, value: Duration) -> timedelta | str | None:
    """``value`` as idem_begin's interval argument: seconds become a
    ``timedelta``; the server checks the value itself (README, "API
    reference"), so a bad one fails there with 22023."""
    if value is None or isinstance(value, (timedelta, str)):
        return value
    number = cast(object, value)  # checked at run time too: untyped callers
    if isinstance(number, (int, float)) and not isinstance(number, bool):
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
        return timedelta(seconds=number)
    raise TypeError(f"{name} must be a timedelta, a number of seconds, an interval's text "
                    f"or None, not {type(value).__name__}")


def policy(name: str, value: str | None, allowed: tuple[str, ...], *, optional: bool = False) -> str | None:
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
    lease: timedelta | str | None
    ttl: timedelta | str | None
    takeover: str | None
    remember: timedelta | str | None

    @classmethod
    def make(cls, in_flight: str, lease: Duration, ttl: Duration, takeover: str | None,
             remember: Duration) -> Settings:
        return cls(policy("in_flight", in_flight, ("wait", "raise")) or "wait",
                   duration("lease", lease), duration("ttl", ttl),
                   policy("takeover", takeover, ("lease", "session"), optional=True),
                   duration("remember", remember))

    def begin_sql(self, checkpoint: bool = False) -> LiteralString:
        """idem_begin's statement; the 1.4 arguments only when set, so that a
        1.3 server serves a coordinator that does not use them.  With
        ``checkpoint``, it also records ``%(checkpoint)s`` on a new claim."""
        extra = ""
        if self.takeover is not None:
            extra += ", takeover => %(takeover)s::text"
        if self.remember is not None:
            extra += ", remember => %(remember)s::interval"
        return _BEGIN.format(extra=extra, checkpoint=_BEGIN_CHECKPOINT if checkpoint else "")

    def begin_params(self, operation: str, key: str, fp: bytes | None) -> dict[str, Any]:
        return {"operation": operation, "key": key, "fingerprint": fp,
                "in_flight": self.in_flight, "lease": self.lease, "ttl": self.ttl,
                "takeover": self.takeover, "remember": self.remember}


@contextlib.contextmanager
def db_errors() -> Generator[None, None, None]:
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

    def __init__(self, operation: str, key: str, row: tuple[Any, Any, Any] | None = None) -> None:
        self.operation = operation
        self.key = key
        self.status: str | None = None
        self.token: int | None = None
        self.response: Any = None
        self.finished = False
        #: whether the claim has a checkpoint: this attempt made one, or it
        #: took over a claim that had one (status 'recover')
        self.checkpointed = False
        if row is not None:
            self._set(row)

    def _set(self, row: tuple[Any, ...]) -> None:
        self.status, self.token, self.response = row[0], row[1], row[2]
        # 'new' with a checkpoint in the claim's statement (a fourth column)
        self.checkpointed = self.status == "recover" or (self.status == "new" and len(row) > 3)

    def _params(self, **extra: Any) -> dict[str, Any]:
        if self.token is None:
            raise RuntimeError(f"no claim held on key {self.key!r} (status {self.status!r})")
        return {"operation": self.operation, "key": self.key, "token": self.token, **extra}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.operation!r} {self.key!r} {self.status} token={self.token}>"


#: the claim of the innermost decorated call running in this context
_current: ContextVar[ClaimState | None] = ContextVar("idempotency_pg_current_claim", default=None)


@contextlib.contextmanager
def running(claim: ClaimState) -> Generator[None, None, None]:
    """The decorated call runs for ``claim``: :func:`current_claim` returns
    it until the block ends (aio.py and sync.py use this)."""
    reset = _current.set(claim)
    try:
        yield
    finally:
        _current.reset(reset)


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
    """A function's result (or a checkpoint's state) as a jsonb parameter,
    through the package's one encoder (:mod:`idempotency_pg.encoding`).  It
    is encoded here, before any statement is sent: a value that cannot be
    stored (a ``set``, ``NaN``) raises ``TypeError`` or ``ValueError`` with
    nothing sent."""
    return encoding.to_jsonb(result)


def unstored_state(err: BaseException) -> dict[str, Any]:
    """The checkpoint state of a claim whose function ran and whose result
    could not be stored (python/README.md, "When the result cannot be
    stored"): what the retry gets with status 'recover'."""
    return {"response_not_stored": {"error": f"{type(err).__name__}: {err}"[:1000],
                                    "sqlstate": error_sqlstate(err)}}


def is_unstored(state: Any) -> bool:
    """Is ``state`` the package's own record of a result that was not stored
    (:func:`unstored_state`), rather than a function's checkpoint or result?"""
    if not isinstance(state, dict) or set(cast(dict[str, Any], state)) != {"response_not_stored"}:
        return False
    inner: Any = cast(dict[str, Any], state)["response_not_stored"]
    return isinstance(inner, dict) and isinstance(cast(dict[str, Any], inner).get("error"), str) and \
        set(cast(dict[str, Any], inner)) <= {"error", "sqlstate"}


def unstored_error(claim: ClaimState, *, completed: bool) -> ResponseNotStoredError:
    """The :class:`ResponseNotStoredError` of an attempt that took over (or
    replays) the record :func:`is_unstored` recognises: the function ran
    in an earlier attempt."""
    inner = claim.response["response_not_stored"]
    sqlstate = inner.get("sqlstate")
    return ResponseNotStoredError(claim.operation, claim.key, claim.token, None, inner["error"],
                                  sqlstate=sqlstate if isinstance(sqlstate, str) else None, detail=None,
                                  checkpointed=not completed, completed=completed)


def error_sqlstate(err: BaseException) -> str | None:
    """The SQLSTATE of a psycopg or idempotency_pg error, else ``None``."""
    return getattr(err, "sqlstate", None)


def error_detail(err: BaseException) -> str | None:
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
S = TypeVar("S")
R_co = TypeVar("R_co", covariant=True)
S_contra = TypeVar("S_contra", contravariant=True)


class IdempotentFunction(Protocol[P, R_co]):
    """What ``Coordinator.idempotent`` makes of a function: called as the
    function is, and ``outcome(...)`` -- the same call, returning an
    :class:`Outcome`."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome: ...


class BoundIdempotentFunction(Protocol[P, R_co]):
    """A decorated method reached through an instance: called as the method
    is (``outcome`` is reached through the class)."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


class IdempotentMethod(Protocol[S_contra, P, R_co]):
    """What ``Coordinator.idempotent`` makes of a function with a first
    positional parameter, such as a method's ``self``: called as the
    function is, ``outcome(...)``, and bound to an instance when reached
    through one (``payments.charge(...)``)."""

    def __call__(self, instance: S_contra, /, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def outcome(self, instance: S_contra, /, *args: P.args, **kwargs: P.kwargs) -> Outcome: ...

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> IdempotentMethod[S_contra, P, R_co]: ...

    @overload
    def __get__(self, instance: S_contra, owner: type[Any] | None = None) -> BoundIdempotentFunction[P, R_co]: ...


class AsyncIdempotentFunction(Protocol[P, R_co]):
    """What ``AsyncCoordinator.idempotent`` makes of an ``async def``:
    awaited as the function is, and ``await outcome(...)`` -- the same
    call, returning an :class:`Outcome`."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, Outcome]: ...


class AsyncBoundIdempotentFunction(Protocol[P, R_co]):
    """:class:`BoundIdempotentFunction` for an ``async def``."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...


class AsyncIdempotentMethod(Protocol[S_contra, P, R_co]):
    """:class:`IdempotentMethod` for an ``async def``."""

    def __call__(self, instance: S_contra, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def outcome(self, instance: S_contra, /, *args: P.args,
                **kwargs: P.kwargs) -> Coroutine[Any, Any, Outcome]: ...

    @overload
    def __get__(self, instance: None,
                owner: type[Any] | None = None) -> AsyncIdempotentMethod[S_contra, P, R_co]: ...

    @overload
    def __get__(self, instance: S_contra,
                owner: type[Any] | None = None) -> AsyncBoundIdempotentFunction[P, R_co]: ...


class Decorator(Protocol):
    """What ``Coordinator.idempotent(...)`` returns: it keeps the decorated
    function's signature, and binds a method's ``self``."""

    # a function with a first positional parameter matches both: the first wins
    @overload
    def __call__(self, func: Callable[Concatenate[S, P], R]) -> IdempotentMethod[S, P, R]: ...  # type: ignore[misc]

    @overload
    def __call__(self, func: Callable[P, R]) -> IdempotentFunction[P, R]: ...


class AsyncDecorator(Protocol):
    """What ``AsyncCoordinator.idempotent(...)`` returns: it keeps the
    decorated ``async def``'s signature, and binds a method's ``self``."""

    # a function with a first positional parameter matches both: the first wins
    @overload
    def __call__(self, func: Callable[Concatenate[S, P], Awaitable[R]]  # type: ignore[misc]
                 ) -> AsyncIdempotentMethod[S, P, R]: ...

    @overload
    def __call__(self, func: Callable[P, Awaitable[R]]) -> AsyncIdempotentFunction[P, R]: ...


def from_json(value: Any, result_type: Any | None) -> Any:
    """A stored response as the caller's result: restored to ``result_type``
    (:func:`idempotency_pg.encoding.decode`), or the JSON value as psycopg
    loads it."""
    return encoding.decode(value, result_type)


class ResultCodec:
    """How a decorated function's results are restored: to ``result_type``
    when given, else to the function's return annotation, resolved at the
    first call (so that it may name a class defined after the function)."""

    def __init__(self, func: Callable[..., Any], result_type: Any | None) -> None:
        self._func = func
        self._type = result_type
        self._resolved = result_type is not None

    def decode(self, value: Any) -> Any:
        if not self._resolved:
            try:
                hint = typing.get_type_hints(self._func).get("return")
            except Exception as err:
                log.warning("the return annotation of %s does not resolve (%s): its results are "
                            "returned as stored JSON; give result_type=", self._func.__qualname__, err)
                hint = None
            # a coroutine function's annotation is its result's
            self._type, self._resolved = hint, True
        return encoding.decode(value, self._type)


def _path_value(value: Any, attrs: Sequence[str]) -> Any:
    for attr in attrs:
        value = cast(Mapping[str, Any], value)[attr] if isinstance(value, Mapping) else getattr(value, attr)
    return value


class CallSpec:
    """How a decorated function's call maps to a key, a fingerprint and (for
    the free decorator) its coordinator.  ``fingerprint_params`` and a
    coordinator named by a string are parameter names, each optionally
    followed by attributes (or mapping keys): ``"body.amount"``,
    ``"self.coordinator"``."""

    def __init__(self, func: Callable[..., Any], fingerprint_params: Sequence[str],
                 key_param: str = "idempotency_key", coordinator_path: str | None = None) -> None:
        self.signature = inspect.signature(func)
        params = self.signature.parameters
        # checked at run time too: untyped callers
        if not isinstance(cast(object, key_param), str) or key_param not in params:
            raise TypeError(f"{func.__qualname__} must take an {key_param}= argument (key_param)")
        if isinstance(fingerprint_params, str):
            raise TypeError("fingerprint_params must be a sequence of parameter names, not a str")
        for name in fingerprint_params:
            if name.split(".")[0] not in params:
                raise TypeError(f"fingerprint parameter {name!r} is not a parameter of {func.__qualname__}")
        if coordinator_path is not None and coordinator_path.split(".")[0] not in params:
            raise TypeError(f"coordinator={coordinator_path!r} does not name a parameter of {func.__qualname__}")
        self.key_param = key_param
        self.fingerprint_params = tuple(tuple(n.split(".")) for n in fingerprint_params)
        self.coordinator_path = None if coordinator_path is None else tuple(coordinator_path.split("."))

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    def key(self, bound: inspect.BoundArguments) -> str | None:
        key: str | None = bound.arguments[self.key_param]
        return key

    def fingerprint(self, bound: inspect.BoundArguments) -> bytes:
        return fingerprint(*(_path_value(bound.arguments[p[0]], p[1:]) for p in self.fingerprint_params))

    def key_and_fingerprint(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, bytes]:
        bound = self.bind(args, kwargs)
        key = self.key(bound)
        return (None, b"") if key is None else (key, self.fingerprint(bound))

    def coordinator(self, binding: Any, bound: inspect.BoundArguments) -> Any:
        """The coordinator of this call: named by a parameter path, made by
        a callable (called with no arguments), or given."""
        if self.coordinator_path is not None:
            return _path_value(bound.arguments[self.coordinator_path[0]], self.coordinator_path[1:])
        if callable(binding) and not hasattr(binding, "settings"):
            return binding()
        return binding


#: what the free decorator takes as ``coordinator=``: the coordinator, the
#: name of the parameter (and attributes) that holds it (``"self.coordinator"``),
#: or a callable that returns it at the call
Binding = str | Callable[[], Any] | Any


@dataclass(frozen=True)
class Overrides:
    """The claim arguments a decorator gives, over its coordinator's."""

    in_flight: str | None = None
    lease: timedelta | str | None = None
    ttl: timedelta | str | None = None
    takeover: str | None = None
    remember: timedelta | str | None = None
    wait_timeout: timedelta | None = None

    @classmethod
    def make(cls, in_flight: str | None, lease: Duration, ttl: Duration, takeover: str | None,
             remember: Duration, wait_timeout: Duration) -> Overrides:
        return cls(policy("in_flight", in_flight, ("wait", "raise"), optional=True),
                   duration("lease", lease), duration("ttl", ttl),
                   policy("takeover", takeover, ("lease", "session"), optional=True),
                   duration("remember", remember), wait_duration(wait_timeout))

    def apply(self, settings: Settings) -> Settings:
        return Settings(self.in_flight or settings.in_flight,
                        settings.lease if self.lease is None else self.lease,
                        settings.ttl if self.ttl is None else self.ttl,
                        settings.takeover if self.takeover is None else self.takeover,
                        settings.remember if self.remember is None else self.remember)


def wait_duration(value: Duration) -> timedelta | None:
    """A ``wait_timeout``: a positive ``timedelta`` or seconds, or ``None``
    (wait as long as the server lets the statement run)."""
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError("wait_timeout must be a timedelta or a number of seconds, not a str")
    span = duration("wait_timeout", value)
    assert isinstance(span, timedelta)
    if span <= timedelta(0):
        raise ValueError(f"wait_timeout must be positive, not {value!r}")
    return span


# A claim with a wait_timeout: one simple-protocol string, run as one
# implicit transaction, so that the setting (local to it) ends with it,
# committed or not; PostgreSQL arms statement_timeout for each statement of
# the string as it starts (docs/api.md, "API reference": a cancelled wait changes
# nothing).
WAIT_PREFIX = "SELECT set_config('statement_timeout', %(wait_timeout)s, true); "


def wait_ms(span: timedelta) -> str:
    return f"{max(1, math.ceil(span / timedelta(milliseconds=1)))}ms"


def statement_timeout(err: BaseException, ran: float, wait_timeout: timedelta) -> bool:
    """Was ``err`` a statement cancelled by the ``statement_timeout`` of
    ``wait_timeout``, after it ran ``ran`` seconds (measured here)?  A
    cancel from elsewhere (``pg_cancel_backend``) is the same SQLSTATE
    (57014); what tells them apart is not the server's message, which is
    translated (``lc_messages``), but when it came: the server's timer
    starts after the statement left here."""
    return (isinstance(err, psycopg.errors.QueryCanceled)
            and ran >= wait_timeout.total_seconds())


# ------------------------------------------------------------------ outcomes

#: ``on_outcome(operation, outcome)``: called once per claim with one of
#: :data:`OUTCOMES`
OutcomeHook = Callable[[str, str], None]

#: what a claim can come to: idem_begin's statuses, its refusals, and a call
#: run unguarded because the store could not be reached (``on_store_error="run"``)
OUTCOMES = ("new", "replay", "recover", "in_progress", "key_reuse", "expired", "store_error")


def outcome_of_error(err: BaseException) -> str | None:
    if isinstance(err, InProgressError):
        return "in_progress"
    if isinstance(err, KeyReuseError):
        return "key_reuse"
    if isinstance(err, ResponseExpiredError):
        return "expired"
    return None


def report(hook: OutcomeHook | None, operation: str, key: str, outcome: str) -> None:
    """Log a claim's outcome (debug, logger ``idempotency_pg``) and count it
    through the hook; a failing hook is logged, never raised."""
    log.debug("idempotency key %r of %r: %s", key, operation, outcome)
    if hook is not None:
        try:
            hook(operation, outcome)
        except Exception:
            log.exception("the on_outcome hook failed for %r, %r", operation, outcome)


def store_unreachable(err: BaseException) -> bool:
    """Could the store not be reached (no connection, none in time, the
    server shutting down)?  Not a refusal of the contract, a SQL error or a
    statement's timeout."""
    if isinstance(err, PoolTimeout):
        return True
    if not isinstance(err, psycopg.OperationalError):
        return False
    state = err.sqlstate
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03")


# ------------------------------------------------------------------ versions

#: the extension version whose API this package needs (docs/upgrading.md, "Upgrading")
REQUIRED_VERSION = (1, 4)
#: the extension's version; and, where there is no extension, whether the
#: search_path finds the portable edition's idem_portable_version() (its psql
#: script installs it into a schema, without a pg_extension row)
VERSION_SQL = ("SELECT (SELECT extversion FROM pg_extension WHERE extname = 'idempotency'),"
               " to_regprocedure('idem_portable_version()') IS NOT NULL")
PORTABLE_VERSION_SQL = "SELECT idem_portable_version()"


def check_version(installed: str | None, schema: bool = False,
                  required: tuple[int, int] = REQUIRED_VERSION) -> None:
    """Raise :class:`ExtensionVersionError` unless ``installed`` (extversion,
    or the version of the portable edition installed into a schema:
    ``schema``) is at least ``required``."""
    if installed is not None:
        parts = re.findall(r"\d+", installed)[:2]
        if len(parts) == 2 and (int(parts[0]), int(parts[1])) >= required:
            return
    raise ExtensionVersionError(installed, required, schema=schema)


# ------------------------------------------------------------------ records

RECORD_SQL = ("SELECT state, token, created_at, lease_until, completed_at, expires_at, remembered_until,"
              " lease_until - clock_timestamp(), clock_timestamp() - created_at"
              "  FROM idem_inspect(%(operation)s::text, %(key)s::text)")


@dataclass(frozen=True)
class Record:
    """``idem_inspect``'s row for a key (docs/api.md, "Operations"), and
    ``lease_remaining``: the time left of a pending claim's lease, by the
    server's clock (negative once it lapsed); ``age``: how long ago the
    record was made, by the same clock."""

    state: str
    token: int
    created_at: datetime
    lease_until: datetime | None
    completed_at: datetime | None
    expires_at: datetime | None
    remembered_until: datetime | None
    lease_remaining: timedelta | None
    age: timedelta | None = None


def serialization_retry(err: psycopg.Error, attempt: int) -> bool:
    """Send a statement again after 40001 (docs/errors.md): idem_begin (the
    retry replays a concurrent result), or a held claim's autocommitted
    finish, abort or checkpoint (nothing was done)?"""
    return err.sqlstate == "40001" and attempt < SERIALIZATION_RETRIES


def pool_setting(value: Any) -> Any:
    """A pool's ``conninfo`` or ``kwargs``: psycopg_pool 3.3 takes either as a
    value or as a callable that gives it (in an async pool, maybe an
    awaitable); this is the value, or what the callable gives."""
    return value() if callable(value) else value
