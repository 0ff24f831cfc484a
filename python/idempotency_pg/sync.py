"""The synchronous API: :class:`Coordinator` over a ``psycopg_pool.ConnectionPool``,
and :class:`Claim`; the same names and semantics as the asyncio API.

This file mirrors :mod:`idempotency_pg.aio` line by line (as psycopg keeps its
sync and async classes): a change to one is made to the other.  What does not
depend on the I/O style lives in :mod:`idempotency_pg._core`."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar

import psycopg
from psycopg import Connection
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from . import _core
from ._core import ABORT_SQL, CHECKPOINT_SQL, FINISH_SQL, ClaimState, Outcome, db_errors
from .errors import RecoveryNeededError

log = logging.getLogger("idempotency_pg")
F = TypeVar("F", bound=Callable[..., Any])
Row = Tuple[Any, ...]


def _execute(conn: Connection[Any], sql: str, params: Any, prepare: Optional[bool]) -> Row:
    """One statement on ``conn``, its first row.  (Ctrl-C cancels the
    statement in the server: psycopg does that for sync connections.)"""
    with db_errors():
        row = conn.execute(sql, params, prepare=prepare).fetchone()
    assert row is not None
    return row


def _autocommit(pool: ConnectionPool, sql: str, params: Any, prepare: Optional[bool]) -> Row:
    """One statement in autocommit on a connection of ``pool``, which goes
    back to the pool as soon as the statement is done."""
    with pool.connection() as conn:
        if conn.autocommit:
            return _execute(conn, sql, params, prepare)
        conn.autocommit = True
        try:
            return _execute(conn, sql, params, prepare)
        finally:
            if not conn.closed:
                conn.autocommit = False


class Claim(ClaimState):
    """A claim on one key: ``status``, ``token``, ``response`` (see
    :class:`~idempotency_pg._core.ClaimState`), and the calls that end it.

    Made by :meth:`Coordinator.claim` (the in-transaction shape: every
    call runs on the caller's connection, in its transaction) and by the
    decorator (the external-call shape: every call is autocommitted on a
    connection of the coordinator's ``pool``).
    """

    def __init__(self, coordinator: "Coordinator", operation: str, key: str,
                 fingerprint: Optional[bytes], conn: Optional[Connection[Any]] = None) -> None:
        super().__init__(operation, key)
        self._coordinator = coordinator
        self._fingerprint = fingerprint
        self._conn = conn

    def _run(self, sql: str, params: Any) -> Row:
        if self._conn is not None:
            return _execute(self._conn, sql, params, self._coordinator.prepare)
        return _autocommit(self._coordinator.pool, sql, params, self._coordinator.prepare)

    def __enter__(self) -> "Claim":
        assert self._conn is not None
        c = self._coordinator
        self._set(_execute(self._conn, c._begin_sql,
                                 c.settings.begin_params(self.operation, self.key, self._fingerprint),
                                 c.prepare))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # An exception with the claim held and the transaction still usable:
        # release it, so that a commit by the caller cannot keep it pending.
        # (A failed transaction rolls back, which releases it anyway.)
        if (exc_type is not None and self.token is not None and not self.finished
                and self._conn is not None and not self._conn.closed
                and self._conn.info.transaction_status == TransactionStatus.INTRANS):
            self.abort()

    def finish(self, result: Any) -> Any:
        """``idem_finish``: store ``result`` (JSON-serialisable, or a pydantic
        model) as the key's response.  Returns the response as stored -- what
        every replay gets.  Raises :class:`LostClaimError` (IK412) if the token
        no longer holds the key, :class:`ResponseTooLargeError` (54000)."""
        row = self._run(FINISH_SQL, self._params(response=_core.to_json(result)))
        self.finished = True
        return row[1]

    def abort(self) -> bool:
        """``idem_abort``: release the claim (errors are not cached).  Returns
        ``False`` if the token no longer held the key (nothing changed)."""
        row = self._run(ABORT_SQL, self._params())
        self.finished = True
        return bool(row[0])

    def checkpoint(self, state: Any) -> None:
        """``idem_checkpoint`` (extension 1.4): record ``state`` (JSON) as the
        claim's progress; a takeover after the lease lapses gets status
        ``'recover'`` with it.  Raises :class:`LostClaimError` (IK412)."""
        self._run(CHECKPOINT_SQL, self._params(state=_core.to_json(state)))


class Coordinator:
    """Idempotency-Key semantics for synchronous code over a ``ConnectionPool``.

    ``pool``: finishes, aborts and checkpoints run here, each in autocommit.
    Claims with ``in_flight="wait"`` run on a second pool, ``claim_pool``
    (README, "From an application": a waiting idem_begin holds its
    connection until the first attempt finishes, so finishing must never
    queue behind waiters): pass one, or the coordinator makes one from
    ``pool``'s connection settings, of ``claim_pool_size`` connections
    (default: ``pool.max_size``), opened on first use and closed by
    :meth:`close` (or ``with coordinator``).  With ``in_flight="raise"``
    claims never wait and run on ``pool``.

    ``lease``, ``ttl`` and (extension 1.4) ``takeover``, ``remember`` are
    passed to every idem_begin (``None``: the server's setting).  ``prepare``
    is psycopg's ``execute(prepare=)``: ``None`` prepares a statement after
    it has run a few times on a connection.
    """

    def __init__(self, pool: ConnectionPool, *, in_flight: str = "wait",
                 lease: Optional[timedelta] = timedelta(seconds=30),
                 ttl: Optional[timedelta] = timedelta(hours=24),
                 takeover: Optional[str] = None, remember: Optional[timedelta] = None,
                 claim_pool: Optional[ConnectionPool] = None,
                 claim_pool_size: Optional[int] = None, prepare: Optional[bool] = None) -> None:
        if claim_pool is pool:
            raise ValueError("claim_pool must be another pool than pool (README, \"From an application\")")
        self.pool = pool
        self.settings = _core.Settings(in_flight, lease, ttl, takeover, remember)
        self.prepare = prepare
        self._claim_pool = claim_pool
        self._own_claim_pool: Optional[ConnectionPool] = None
        self._claim_pool_size = claim_pool_size
        self._opening = threading.Lock()
        self._begin_sql = self.settings.begin_sql()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the claim pool the coordinator made, if it made one."""
        if self._own_claim_pool is not None:
            pool, self._own_claim_pool = self._own_claim_pool, None
            pool.close()

    def _claims(self) -> ConnectionPool:
        if self.settings.in_flight == "raise":
            return self.pool
        if self._claim_pool is not None:
            return self._claim_pool
        with self._opening:
            if self._own_claim_pool is None:
                p = self.pool
                own = ConnectionPool(
                    p.conninfo, kwargs={**(p.kwargs or {}), "autocommit": True},
                    connection_class=p.connection_class, min_size=1,
                    max_size=self._claim_pool_size or p.max_size, timeout=p.timeout,
                    name=f"{p.name}.claims", open=False)
                own.open()
                self._own_claim_pool = own
            return self._own_claim_pool

    def begin(self, operation: str, key: str, fingerprint: Optional[bytes]) -> Claim:
        """``idem_begin`` in autocommit, the external-call shape: the claim is
        committed when this returns, and the connection is back in its pool.
        End a ``'new'`` or ``'recover'`` claim with ``finish`` or ``abort``.

        Raises :class:`InProgressError` (IK409), :class:`KeyReuseError`
        (IK422), :class:`ResponseExpiredError` (IK410),
        :class:`InvalidRequestError`; a wait cut short by
        ``statement_timeout`` raises psycopg's ``QueryCanceled``."""
        claim = Claim(self, operation, key, fingerprint)
        pool = self._claims()
        params = self.settings.begin_params(operation, key, fingerprint)
        for attempt in range(1, _core.SERIALIZATION_RETRIES + 1):
            try:
                claim._set(_autocommit(pool, self._begin_sql, params, self.prepare))
                return claim
            except psycopg.Error as err:
                if not _core.serialization_retry(err, attempt):
                    raise
        raise AssertionError("unreachable")

    def claim(self, conn: Connection[Any], operation: str, key: str,
              fingerprint: Optional[bytes]) -> Claim:
        """The in-transaction shape: ``with coordinator.claim(conn, ...)
        as c`` runs ``idem_begin`` on ``conn``, in its transaction.  On
        ``c.status == 'new'`` do the effect on ``conn`` and ``await
        c.finish(result)``; on ``'replay'`` use ``c.response``.  Commit (or
        roll back) is the caller's.  An exception out of the block with the
        claim unfinished aborts it if the transaction can still run
        statements.  Raises as :meth:`begin` does."""
        return Claim(self, operation, key, fingerprint, conn)

    def idempotent(self, operation: str, *, fingerprint_params: Sequence[str] = (),
                   result_type: Optional[type] = None,
                   recover: Optional[Callable[..., Any]] = None) -> Callable[[F], F]:
        """Decorate a function that takes ``idempotency_key=``.

        With a key, the function runs once per key (the external-call shape:
        claim, call, finish) and every call returns an equal result: what the
        first call's result was stored as (JSON, or ``result_type`` -- a
        pydantic model -- validated from it).  ``fingerprint_params`` names
        the arguments that make the request *this* request (values of the
        types :func:`~idempotency_pg.fingerprint` takes).  With key ``None``
        the function just runs.  An exception in the function aborts the
        claim and is re-raised: errors are not cached.  Inside the function,
        :func:`current_claim` is its claim (for ``checkpoint``).

        ``recover`` (extension 1.4): called as ``recover(state, *args,
        **kwargs)``  when the call took over a claim that
        had a checkpoint; its result is stored as the function's would be.
        Without it such a call raises :class:`RecoveryNeededError`.  Either
        way the claim is not aborted on failure: its checkpoint is kept for
        the next attempt.

        The wrapper raises what :meth:`begin` and :meth:`Claim.finish`
        raise.  ``wrapper.outcome(...)`` returns an :class:`Outcome` instead
        (the value and whether it was a replay)."""

        def decorate(func: F) -> F:
            if inspect.iscoroutinefunction(func):
                raise TypeError(f"{func.__qualname__} is an async function: use AsyncCoordinator")
            spec = _core.CallSpec(func, fingerprint_params)

            def outcome(*args: Any, **kwargs: Any) -> Outcome:
                key, fp = spec.key_and_fingerprint(args, kwargs)
                if key is None:
                    return Outcome(func(*args, **kwargs), False)
                claim = self.begin(operation, key, fp)
                if claim.status == "replay":
                    return Outcome(_core.from_json(claim.response, result_type), True)
                reset = _core._current.set(claim)
                try:
                    if claim.status == "recover":
                        result = _recover(claim, recover, args, kwargs)
                    else:
                        result = _run_or_abort(claim, func, args, kwargs)
                finally:
                    _core._current.reset(reset)
                stored = claim.finish(result)
                return Outcome(_core.from_json(stored, result_type), False)

            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return outcome(*args, **kwargs).value

            wrapper.outcome = outcome  # type: ignore[attr-defined]
            return wrapper  # type: ignore[return-value]

        return decorate


def _run_or_abort(claim: Claim, func: Callable[..., Any],
                        args: Tuple[Any, ...], kwargs: Any) -> Any:
    try:
        return func(*args, **kwargs)
    except BaseException:
        try:
            claim.abort()
        except Exception:  # the lease releases it
            log.exception("idem_abort failed for key %r of %r", claim.key, claim.operation)
        raise


def _recover(claim: Claim, recover: Optional[Callable[..., Any]],
                   args: Tuple[Any, ...], kwargs: Any) -> Any:
    if recover is None:
        assert claim.token is not None
        raise RecoveryNeededError(claim.operation, claim.key, claim.token, claim.response)
    return recover(claim.response, *args, **kwargs)
