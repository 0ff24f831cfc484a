"""The asyncio API: :class:`AsyncCoordinator` over a
``psycopg_pool.AsyncConnectionPool``, and :class:`AsyncClaim`."""

from __future__ import annotations

import asyncio
import functools
import logging
from datetime import timedelta
from typing import Any, Awaitable, Callable, Optional, Sequence, Tuple, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from . import _core
from ._core import ABORT_SQL, CHECKPOINT_SQL, FINISH_SQL, ClaimState, Outcome, db_errors
from .errors import RecoveryNeededError

log = logging.getLogger("idempotency_pg")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
Row = Tuple[Any, ...]


async def _execute(conn: AsyncConnection[Any], sql: str, params: Any, prepare: Optional[bool]) -> Row:
    """One statement on ``conn``, its first row.  A cancelled call (task
    cancellation) cancels the statement in the server and closes the
    connection, so that a waiting idem_begin does not go on waiting (README:
    a cancelled wait changes nothing); the pool replaces the connection."""
    with db_errors():
        try:
            cur = await conn.execute(sql, params, prepare=prepare)
        except asyncio.CancelledError:
            try:
                await asyncio.to_thread(conn.cancel)
            finally:
                await conn.close()
            raise
        row = await cur.fetchone()
    assert row is not None
    return row


async def _autocommit(pool: AsyncConnectionPool, sql: str, params: Any, prepare: Optional[bool]) -> Row:
    """One statement in autocommit on a connection of ``pool``, which goes
    back to the pool as soon as the statement is done."""
    async with pool.connection() as conn:
        if conn.autocommit:
            return await _execute(conn, sql, params, prepare)
        await conn.set_autocommit(True)
        try:
            return await _execute(conn, sql, params, prepare)
        finally:
            if not conn.closed:
                await conn.set_autocommit(False)


class AsyncClaim(ClaimState):
    """A claim on one key: ``status``, ``token``, ``response`` (see
    :class:`~idempotency_pg._core.ClaimState`), and the calls that end it.

    Made by :meth:`AsyncCoordinator.claim` (the in-transaction shape: every
    call runs on the caller's connection, in its transaction) and by the
    decorator (the external-call shape: every call is autocommitted on a
    connection of the coordinator's ``pool``).
    """

    def __init__(self, coordinator: "AsyncCoordinator", operation: str, key: str,
                 fingerprint: Optional[bytes], conn: Optional[AsyncConnection[Any]] = None) -> None:
        super().__init__(operation, key)
        self._coordinator = coordinator
        self._fingerprint = fingerprint
        self._conn = conn

    async def _run(self, sql: str, params: Any) -> Row:
        if self._conn is not None:
            return await _execute(self._conn, sql, params, self._coordinator.prepare)
        return await _autocommit(self._coordinator.pool, sql, params, self._coordinator.prepare)

    async def __aenter__(self) -> "AsyncClaim":
        assert self._conn is not None
        c = self._coordinator
        self._set(await _execute(self._conn, c._begin_sql,
                                 c.settings.begin_params(self.operation, self.key, self._fingerprint),
                                 c.prepare))
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # An exception with the claim held and the transaction still usable:
        # release it, so that a commit by the caller cannot keep it pending.
        # (A failed transaction rolls back, which releases it anyway.)
        if (exc_type is not None and self.token is not None and not self.finished
                and self._conn is not None and not self._conn.closed
                and self._conn.info.transaction_status == TransactionStatus.INTRANS):
            await self.abort()

    async def finish(self, result: Any) -> Any:
        """``idem_finish``: store ``result`` (JSON-serialisable, or a pydantic
        model) as the key's response.  Returns the response as stored -- what
        every replay gets.  Raises :class:`LostClaimError` (IK412) if the token
        no longer holds the key, :class:`ResponseTooLargeError` (54000)."""
        row = await self._run(FINISH_SQL, self._params(response=_core.to_json(result)))
        self.finished = True
        return row[1]

    async def abort(self) -> bool:
        """``idem_abort``: release the claim (errors are not cached).  Returns
        ``False`` if the token no longer held the key (nothing changed)."""
        row = await self._run(ABORT_SQL, self._params())
        self.finished = True
        return bool(row[0])

    async def checkpoint(self, state: Any) -> None:
        """``idem_checkpoint`` (extension 1.4): record ``state`` (JSON) as the
        claim's progress; a takeover after the lease lapses gets status
        ``'recover'`` with it.  Raises :class:`LostClaimError` (IK412)."""
        await self._run(CHECKPOINT_SQL, self._params(state=_core.to_json(state)))


class AsyncCoordinator:
    """Idempotency-Key semantics for asyncio code over an ``AsyncConnectionPool``.

    ``pool``: finishes, aborts and checkpoints run here, each in autocommit.
    Claims with ``in_flight="wait"`` run on a second pool, ``claim_pool``
    (README, "From an application": a waiting idem_begin holds its
    connection until the first attempt finishes, so finishing must never
    queue behind waiters): pass one, or the coordinator makes one from
    ``pool``'s connection settings, of ``claim_pool_size`` connections
    (default: ``pool.max_size``), opened on first use and closed by
    :meth:`close` (or ``async with coordinator``).  With ``in_flight="raise"``
    claims never wait and run on ``pool``.

    ``lease``, ``ttl`` and (extension 1.4) ``takeover``, ``remember`` are
    passed to every idem_begin (``None``: the server's setting).  ``prepare``
    is psycopg's ``execute(prepare=)``: ``None`` prepares a statement after
    it has run a few times on a connection.
    """

    def __init__(self, pool: AsyncConnectionPool, *, in_flight: str = "wait",
                 lease: Optional[timedelta] = timedelta(seconds=30),
                 ttl: Optional[timedelta] = timedelta(hours=24),
                 takeover: Optional[str] = None, remember: Optional[timedelta] = None,
                 claim_pool: Optional[AsyncConnectionPool] = None,
                 claim_pool_size: Optional[int] = None, prepare: Optional[bool] = None) -> None:
        if claim_pool is pool:
            raise ValueError("claim_pool must be another pool than pool (README, \"From an application\")")
        self.pool = pool
        self.settings = _core.Settings(in_flight, lease, ttl, takeover, remember)
        self.prepare = prepare
        self._claim_pool = claim_pool
        self._own_claim_pool: Optional[AsyncConnectionPool] = None
        self._claim_pool_size = claim_pool_size
        self._opening = asyncio.Lock()
        self._begin_sql = self.settings.begin_sql()

    async def __aenter__(self) -> "AsyncCoordinator":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the claim pool the coordinator made, if it made one."""
        if self._own_claim_pool is not None:
            pool, self._own_claim_pool = self._own_claim_pool, None
            await pool.close()

    async def _claims(self) -> AsyncConnectionPool:
        if self.settings.in_flight == "raise":
            return self.pool
        if self._claim_pool is not None:
            return self._claim_pool
        async with self._opening:
            if self._own_claim_pool is None:
                p = self.pool
                own = AsyncConnectionPool(
                    p.conninfo, kwargs={**(p.kwargs or {}), "autocommit": True},
                    connection_class=p.connection_class, min_size=1,
                    max_size=self._claim_pool_size or p.max_size, timeout=p.timeout,
                    name=f"{p.name}.claims", open=False)
                await own.open()
                self._own_claim_pool = own
            return self._own_claim_pool

    async def begin(self, operation: str, key: str, fingerprint: Optional[bytes]) -> AsyncClaim:
        """``idem_begin`` in autocommit, the external-call shape: the claim is
        committed when this returns, and the connection is back in its pool.
        End a ``'new'`` or ``'recover'`` claim with ``finish`` or ``abort``.

        Raises :class:`InProgressError` (IK409), :class:`KeyReuseError`
        (IK422), :class:`ResponseExpiredError` (IK410),
        :class:`InvalidRequestError`; a wait cut short by
        ``statement_timeout`` raises psycopg's ``QueryCanceled``."""
        claim = AsyncClaim(self, operation, key, fingerprint)
        pool = await self._claims()
        params = self.settings.begin_params(operation, key, fingerprint)
        for attempt in range(1, _core.SERIALIZATION_RETRIES + 1):
            try:
                claim._set(await _autocommit(pool, self._begin_sql, params, self.prepare))
                return claim
            except psycopg.Error as err:
                if not _core.serialization_retry(err, attempt):
                    raise
        raise AssertionError("unreachable")

    def claim(self, conn: AsyncConnection[Any], operation: str, key: str,
              fingerprint: Optional[bytes]) -> AsyncClaim:
        """The in-transaction shape: ``async with coordinator.claim(conn, ...)
        as c`` runs ``idem_begin`` on ``conn``, in its transaction.  On
        ``c.status == 'new'`` do the effect on ``conn`` and ``await
        c.finish(result)``; on ``'replay'`` use ``c.response``.  Commit (or
        roll back) is the caller's.  An exception out of the block with the
        claim unfinished aborts it if the transaction can still run
        statements.  Raises as :meth:`begin` does."""
        return AsyncClaim(self, operation, key, fingerprint, conn)

    def idempotent(self, operation: str, *, fingerprint_params: Sequence[str] = (),
                   result_type: Optional[type] = None,
                   recover: Optional[Callable[..., Any]] = None) -> Callable[[F], F]:
        """Decorate an ``async def`` that takes ``idempotency_key=``.

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
        **kwargs)`` (it may be async) when the call took over a claim that
        had a checkpoint; its result is stored as the function's would be.
        Without it such a call raises :class:`RecoveryNeededError`.  Either
        way the claim is not aborted on failure: its checkpoint is kept for
        the next attempt.

        The wrapper raises what :meth:`begin` and :meth:`AsyncClaim.finish`
        raise.  ``wrapper.outcome(...)`` returns an :class:`Outcome` instead
        (the value and whether it was a replay)."""

        def decorate(func: F) -> F:
            if not asyncio.iscoroutinefunction(func):
                raise TypeError(f"{func.__qualname__} is not an async function: use Coordinator")
            spec = _core.CallSpec(func, fingerprint_params)

            async def outcome(*args: Any, **kwargs: Any) -> Outcome:
                key, fp = spec.key_and_fingerprint(args, kwargs)
                if key is None:
                    return Outcome(await func(*args, **kwargs), False)
                claim = await self.begin(operation, key, fp)
                if claim.status == "replay":
                    return Outcome(_core.from_json(claim.response, result_type), True)
                reset = _core._current.set(claim)
                try:
                    if claim.status == "recover":
                        result = await _recover(claim, recover, args, kwargs)
                    else:
                        result = await _run_or_abort(claim, func, args, kwargs)
                finally:
                    _core._current.reset(reset)
                stored = await claim.finish(result)
                return Outcome(_core.from_json(stored, result_type), False)

            @functools.wraps(func)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                return (await outcome(*args, **kwargs)).value

            wrapper.outcome = outcome  # type: ignore[attr-defined]
            return wrapper  # type: ignore[return-value]

        return decorate


async def _run_or_abort(claim: AsyncClaim, func: Callable[..., Awaitable[Any]],
                        args: Tuple[Any, ...], kwargs: Any) -> Any:
    try:
        return await func(*args, **kwargs)
    except BaseException:
        try:
            await claim.abort()
        except Exception:  # the lease releases it
            log.exception("idem_abort failed for key %r of %r", claim.key, claim.operation)
        raise


async def _recover(claim: AsyncClaim, recover: Optional[Callable[..., Any]],
                   args: Tuple[Any, ...], kwargs: Any) -> Any:
    if recover is None:
        assert claim.token is not None
        raise RecoveryNeededError(claim.operation, claim.key, claim.token, claim.response)
    result = recover(claim.response, *args, **kwargs)
    if asyncio.iscoroutine(result):
        result = await result
    return result
