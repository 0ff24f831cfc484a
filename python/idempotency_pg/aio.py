# async {
"""The asyncio API: :class:`AsyncCoordinator` over a
``psycopg_pool.AsyncConnectionPool``, and :class:`AsyncClaim`.

tools/async_to_sync makes :mod:`idempotency_pg.sync`, the synchronous API,
from this file (its header says how); what does not depend on the I/O style
lives in :mod:`idempotency_pg._core`."""
# }
# sync {
# """The synchronous API: :class:`Coordinator` over a ``psycopg_pool.ConnectionPool``,
# and :class:`Claim`; the same names and semantics as the asyncio API.
#
# Made from :mod:`idempotency_pg.aio` by tools/async_to_sync: change aio.py
# and run it.  What does not depend on the I/O style lives in
# :mod:`idempotency_pg._core`."""
# }

# The package's modules share _core and each other's underscored members by
# design (one package, one author): pyright's private-usage rule is for
# other people's privates.
# pyright: reportPrivateUsage=false
from __future__ import annotations

import asyncio  # sync: del
import functools
import inspect
import logging
# sync {
# import threading
# }
import time
from collections.abc import Awaitable, Callable, Sequence  # sync: from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, LiteralString, NoReturn, TypeVar, cast

import psycopg
from psycopg import AsyncClientCursor, AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from . import _core
from ._core import (pool_setting, ABORT_SQL, CHECKPOINT_SQL, FINISH_SQL, INSPECT_SQL, PORTABLE_VERSION_SQL,
                    RECORD_SQL, VERSION_SQL, P,
                    AsyncDecorator, AsyncIdempotentFunction, ClaimState, Outcome, Record, Settings, db_errors)
from .errors import (IdempotencyError, LostClaimError, RecoveryNeededError, ResponseNotStoredError,
                     WaitTimeoutError)

log = logging.getLogger("idempotency_pg")
R = TypeVar("R")
Row = tuple[Any, ...]
# async {
#: the tasks storing a response in the background (AsyncClaim._store_later):
#: the event loop keeps only weak references to tasks
_storing: set[asyncio.Task[None]] = set()
# }


async def _execute(conn: AsyncConnection[Any], sql: LiteralString, params: Any, prepare: bool | None,
                   wait: str | None = None) -> Row:
    # async {
    """One statement on ``conn``, its first row.  A cancelled call (task
    cancellation) cancels the statement in the server and closes the
    connection, so that a waiting idem_begin does not go on waiting (docs/api.md:
    a cancelled wait changes nothing); the pool replaces the connection.
    (A connection of the coordinator's serves one attempt at a time, so
    closing it ends no other attempt's claim.)  With ``wait`` (a
    statement_timeout), the statement runs under it, in one string with the
    setting (``_core.WAIT_PREFIX``)."""
    with db_errors():
        try:
            if wait is None:
                cur = await conn.execute(sql, params, prepare=prepare)
            else:
                cur = AsyncClientCursor(conn)
                await cur.execute(_core.WAIT_PREFIX + sql, {**params, "wait_timeout": wait})
                cur.nextset()
        except asyncio.CancelledError:
            try:
                await asyncio.to_thread(conn.cancel)
            finally:
                await conn.close()
            raise
    # }
    # sync {
    # """One statement on ``conn``, its first row.  (Ctrl-C cancels the
    # statement in the server: psycopg does that for sync connections.)  With
    # ``wait`` (a statement_timeout), the statement runs under it, in one
    # string with the setting (``_core.WAIT_PREFIX``)."""
    # with db_errors():
    #     if wait is None:
    #         cur = conn.execute(sql, params, prepare=prepare)
    #     else:
    #         cur = ClientCursor(conn)
    #         cur.execute(_core.WAIT_PREFIX + sql, {**params, "wait_timeout": wait})
    #         cur.nextset()
    # }
        row = await cur.fetchone()
    assert row is not None
    return tuple(row)


async def _retried(conn: AsyncConnection[Any], sql: LiteralString, params: Any, prepare: bool | None) -> Row:
    """One statement of a held claim's (the external-call shape) on
    ``conn``, in autocommit, sent again after a serialization failure
    (40001): the statement's transaction rolled back and nothing was done
    (a Citus shard move raced it, or a server whose
    default_transaction_isolation is repeatable read).  A finish left
    failing so would leave the claim pending after the action ran, for a
    takeover to run it again.  A 40001 in a transaction of the caller's
    (the in-transaction shape, or a connection not idle after the error)
    aborted that transaction: it is raised."""
    attempt = 1
    while True:
        try:
            return await _execute(conn, sql, params, prepare)
        except psycopg.Error as err:
            if (not _core.serialization_retry(err, attempt)
                    or conn.info.transaction_status != TransactionStatus.IDLE):
                raise
            attempt += 1


async def _autocommit(pool: AsyncConnectionPool, sql: LiteralString, params: Any, prepare: bool | None) -> Row:
    """One statement in autocommit on a connection of ``pool``, which goes
    back to the pool as soon as the statement is done."""
    async with pool.connection() as conn:
        return await _autocommit_on(conn, sql, params, prepare)


async def _autocommit_on(conn: AsyncConnection[Any], sql: LiteralString, params: Any, prepare: bool | None) -> Row:
    """One statement in autocommit on ``conn``, a pool's connection, whose
    autocommit is put back as it was."""
    if conn.autocommit:
        return await _execute(conn, sql, params, prepare)
    await conn.set_autocommit(True)  # sync: conn.autocommit = True
    try:
        return await _execute(conn, sql, params, prepare)
    finally:
        if not conn.closed and not conn.broken:
            await conn.set_autocommit(False)  # sync: conn.autocommit = False


async def _version_on(conn: AsyncConnection[Any], run: Callable[..., Awaitable[Row]]) -> tuple[str | None, bool]:  # sync: def _version_on(conn: Connection[Any], run: Callable[..., Row]) -> tuple[str | None, bool]:
    """The installed version, read with ``run`` (:func:`_execute` or
    :func:`_autocommit_on`): the extension's (pg_extension), else what the
    ``idem_portable_version()`` that ``conn``'s search_path finds answers
    (the portable edition installed into a schema by its psql script has
    no pg_extension row), else None; and whether it is that function's."""
    row = await run(conn, VERSION_SQL, None, False)
    if row[0] is None and row[1]:
        return (await run(conn, PORTABLE_VERSION_SQL, None, False))[0], True
    return row[0], False


async def _checkout(pool: AsyncConnectionPool) -> tuple[AsyncConnection[Any], bool]:
    """A connection of ``pool`` in autocommit, checked out until
    :func:`_checkin`; and whether autocommit was switched on for it."""
    conn = await pool.getconn()
    if conn.autocommit:
        return conn, False
    try:
        await conn.set_autocommit(True)  # sync: conn.autocommit = True
    except BaseException:
        await pool.putconn(conn)
        raise
    return conn, True


async def _checkin(pool: AsyncConnectionPool, conn: AsyncConnection[Any], switched: bool, close: bool) -> None:
    """Give back a connection of :func:`_checkout`: closed first if
    ``close`` (the pool replaces it)."""
    try:
        if close and not conn.closed:
            await conn.close()
        elif switched and not conn.closed and not conn.broken:
            await conn.set_autocommit(False)  # sync: conn.autocommit = False
    finally:
        await pool.putconn(conn)


async def _connect(pool: AsyncConnectionPool, **options: Any) -> AsyncConnection[Any]:
    """A new connection with ``pool``'s settings (and ``options``), in
    autocommit, outside the pool: after a lost connection, the pool's idle
    ones may be lost too."""
    conninfo = pool_setting(pool.conninfo)
    given = pool_setting(pool.kwargs)
    # async {
    if inspect.isawaitable(conninfo):
        conninfo = await conninfo
    if inspect.isawaitable(given):
        given = await given
    # }
    kwargs: dict[str, Any] = {**(given or {}), **options, "autocommit": True}
    conn: AsyncConnection[Any] = await pool.connection_class.connect(conninfo, **kwargs)
    return conn


async def _unreachable(coordinator: AsyncCoordinator, err: BaseException) -> bool:
    """Can the store not be reached at all (``on_store_error="run"`` may
    then run the call unguarded)?  A ``PoolTimeout`` alone does not say so:
    a pool whose connections all serve other calls -- duplicates waiting for
    this very key among them -- times out too.  Then a new connection is
    tried: if the server answers, the call must not run unguarded."""
    if not _core.store_unreachable(err):
        return False
    if not isinstance(err, PoolTimeout):
        return True
    try:
        conn = await _connect(coordinator.pool, connect_timeout=max(1, round(coordinator.pool.timeout)))
    except psycopg.Error as probe:
        return _core.store_unreachable(probe)
    await conn.close()
    log.warning("no connection of the pool in time, but the store answers: not running unguarded")
    return False


class AsyncClaim(ClaimState):
    """A claim on one key: ``status``, ``token``, ``response`` (see
    :class:`~idempotency_pg._core.ClaimState`), and the calls that end it.

    Made by :meth:`AsyncCoordinator.claim` (the in-transaction shape: every
    call runs on the caller's connection, in its transaction) and by
    :meth:`AsyncCoordinator.begin` and the decorator (the external-call
    shape: every call is autocommitted on the connection that claimed,
    which the claim keeps checked out of its pool until ``finish``,
    ``abort`` or ``abandon``).
    """

    def __init__(self, coordinator: AsyncCoordinator, operation: str, key: str,
                 fingerprint: bytes | None, conn: AsyncConnection[Any] | None = None) -> None:
        super().__init__(operation, key)
        self._coordinator = coordinator
        self._fingerprint = fingerprint
        self._conn = conn
        # the external-call shape: the connection that claimed, its pool,
        # and whether autocommit was switched on for it
        self._held: AsyncConnection[Any] | None = None
        self._held_pool: AsyncConnectionPool | None = None
        self._switched = False
        self._reconnected = False
        # set by the decorator without recover=: a checkpoint there would
        # leave every later attempt with 'recover' and nothing to answer it
        self._checkpoint_refusal: str | None = None
        # its response is being stored in the background (_store_later)
        self._storing = False

    async def _run(self, sql: LiteralString, params: Any) -> Row:
        prepare = self._coordinator.prepare
        if self._conn is not None:
            return await _execute(self._conn, sql, params, prepare)
        if self._held is not None:
            return await _retried(self._held, sql, params, prepare)
        return await _autocommit(self._coordinator.pool, sql, params, prepare)

    async def _rescue(self, sql: LiteralString, params: Any) -> Row:
        """``sql`` on the held connection; if that connection is (or gets)
        lost, it is let go and ``sql`` runs on a new connection (the pool's
        idle ones may be lost too)."""
        held = self._held
        if held is not None and not held.closed and not held.broken:
            try:
                return await _retried(held, sql, params, self._coordinator.prepare)
            except psycopg.Error as err:
                if not _core.lost_connection(held, err):
                    raise
                log.warning("connection lost on key %r of %r (%s): going on on a new connection",
                            self.key, self.operation, err)
        await self._let_go(close=True)
        self._reconnected = True
        conn = await _connect(self._coordinator.pool)
        try:
            return await _retried(conn, sql, params, self._coordinator.prepare)
        finally:
            await conn.close()

    async def _let_go(self, *, close: bool) -> None:
        """Give the held connection back to its pool (closed first if
        ``close``).  Only a connection that holds no pending claim goes
        back open: another attempt's cancelled call, or the pool's
        ``max_lifetime``, may close it."""
        conn, pool, self._held, self._held_pool = self._held, self._held_pool, None, None
        if conn is not None and pool is not None:
            await _checkin(pool, conn, self._switched, close)

    async def __aenter__(self) -> "AsyncClaim":
        assert self._conn is not None
        c = self._coordinator
        await c._check_version(self._conn)
        try:
            self._set(await _execute(self._conn, c._begin_sql,
                                     c.settings.begin_params(self.operation, self.key, self._fingerprint),
                                     c.prepare))
        except IdempotencyError as err:
            c._refused(self.operation, self.key, err)
            raise
        c._report(self.operation, self.key, str(self.status))
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
        no longer holds the key, :class:`ResponseTooLargeError` (54000),
        ``TypeError`` / ``ValueError`` for a result JSON cannot encode (nothing
        sent).  A connection lost during the finish is replaced once (the
        finish runs again on a new connection; if the first one had
        committed, the stored response is read back)."""
        params = self._params(response=_core.to_json(result))
        if self._held is None:
            row = await self._run(FINISH_SQL, params)
        else:
            try:
                row = await self._rescue(FINISH_SQL, params)
            except LostClaimError:
                if not self._reconnected:
                    raise
                # the finish sent on the lost connection may have committed
                state = await self._rescue(INSPECT_SQL, self._params())
                if state[0] != "completed" or state[1] != self.token:
                    raise
                row = (None, state[2])
        self.finished = True
        await self._let_go(close=False)
        return row[1]

    async def abort(self) -> bool:
        """``idem_abort``: release the claim (errors are not cached).  Returns
        ``False`` if the token no longer held the key (nothing changed)."""
        row = await self._run(ABORT_SQL, self._params())
        self.finished = True
        await self._let_go(close=False)
        return bool(row[0])

    async def checkpoint(self, state: Any) -> None:
        """``idem_checkpoint`` (extension 1.4): record ``state`` (JSON) as the
        claim's progress; a takeover after the lease lapses (or, with
        ``takeover="session"``, once the claiming session ended) gets status
        ``'recover'`` with it.  Raises :class:`LostClaimError` (IK412), and
        ``TypeError`` in a function decorated without ``recover=`` (nothing
        is written)."""
        if self._checkpoint_refusal is not None:
            raise TypeError(self._checkpoint_refusal)
        await self._run(CHECKPOINT_SQL, self._params(state=_core.to_json(state)))
        self.checkpointed = True

    async def abandon(self) -> None:
        """Leave the claim pending and let go of its connection, which is
        closed: a ``'session'`` claim lapses now, a ``'lease'`` claim when
        its lease ends; the next attempt then gets ``'recover'`` if the
        claim has a checkpoint, else ``'new'``.  Nothing happens if the
        claim has ended (finished, aborted), is in-transaction, or has its
        response stored in the background."""
        if not self._storing:
            await self._let_go(close=True)

    def _refused_write(self, err: BaseException) -> bool:
        """Did the server refuse a write of this held claim (``err`` has a
        SQLSTATE, the claim's connection is alive, and the claim is still
        ours: not IK412)?  A read-only server, a trigger, a lock timeout."""
        held = self._held
        return (_core.error_sqlstate(err) is not None and not isinstance(err, LostClaimError)
                and held is not None and not held.closed and not held.broken)

    def _store_later(self, err: BaseException, *responses: Any) -> bool:
        """The last resort after the function ran and nothing about it
        could be written (the last write failed with ``err``): when the
        server refused that write, the claim stays pending on its
        connection, and ``responses`` are stored in the background, in a
        task (a thread for the synchronous API); returns whether they are.
        Meanwhile a duplicate waits (or gets IK409) as for a running
        attempt."""
        if not self._refused_write(err):
            return False
        self._storing = True
        log.error("the response of %r for key %r is not stored (%s: %s): the claim stays pending and it "
                  "is stored in the background", self.operation, self.key, type(err).__name__, err)
        # async {
        task = asyncio.get_running_loop().create_task(self._store_until_stored(responses))
        _storing.add(task)
        task.add_done_callback(_storing.discard)
        # }
        # sync {
        # threading.Thread(target=self._store_until_stored, args=(responses,), daemon=True).start()
        # }
        return True

    async def _store_until_stored(self, responses: Sequence[Any]) -> None:
        """Each round, after a delay from 100 ms doubling up to 5 s, the
        first of ``responses`` that the server stores; until one is, the
        claim is lost (IK412), or so is its connection."""
        delay = 0.1
        while True:
            await asyncio.sleep(delay)  # sync: time.sleep(delay)
            delay = min(delay * 2, 5.0)
            for response in responses:
                try:
                    await self.finish(response)
                except Exception as err:
                    # an encoding error is the response's own: the next one is tried
                    if self._refused_write(err) or isinstance(err, (TypeError, ValueError)):
                        continue
                    log.error("the response of %r for key %r cannot be stored (%s: %s): %s", self.operation,
                              self.key, type(err).__name__, err, "another attempt took the key over"
                              if isinstance(err, LostClaimError) else "the claim lapses with its connection")
                    await self._let_go(close=not isinstance(err, LostClaimError))
                    return
                log.error("the response of %r for key %r is stored after all", self.operation, self.key)
                return


class AsyncCoordinator:
    # async {
    """Idempotency-Key semantics for asyncio code over an ``AsyncConnectionPool``.

    Claims run on ``claim_pool``, each attempt keeping the connection that
    claimed checked out until it finishes or aborts, and running its
    ``finish``, ``abort`` and ``checkpoint`` there (README, "When a worker
    dies": a ``'session'`` claim lapses when that session ends, so no idle
    timeout, ``max_lifetime`` or other call may close it meanwhile).  A
    waiting idem_begin holds its connection until the first attempt
    finishes (docs/applications.md, "From an application"), which it does on its own
    connection, so waiters never hold up a finish.  Pass a ``claim_pool``,
    or the coordinator makes one from ``pool``'s connection settings, of
    ``claim_pool_size`` connections (default: ``pool.max_size``), opened on
    first use and closed by :meth:`close` (or ``async with coordinator``).
    It needs a connection per running attempt and per waiting duplicate.
    ``pool`` serves calls on a claim whose connection was let go.

    ``lease``, ``ttl`` and (extension 1.4) ``takeover``, ``remember`` are
    passed to every idem_begin when given; ``None`` (the default) sends NULL,
    so the server's settings apply (``idempotency.lease``, ...).  Durations
    are ``timedelta``, seconds (``int``, ``float``) or an interval's text;
    ``in_flight`` and ``takeover`` are taken in any case.  ``prepare``
    is psycopg's ``execute(prepare=)``: ``None`` prepares a statement after
    it has run a few times on a connection.

    ``wait_timeout`` (a ``timedelta`` or seconds) bounds how long a claim
    waits for another attempt holding the key: then it raises
    :class:`WaitTimeoutError` (an :class:`InProgressError`).
    ``on_outcome(operation, outcome)`` is called once per claim with its
    outcome (``_core.OUTCOMES``: ``"new"``, ``"replay"``, ``"recover"``,
    ``"in_progress"``, ``"key_reuse"``, ``"expired"``, ``"store_error"``),
    e.g. to count them; each is also logged at debug level (logger
    ``idempotency_pg``).  The first call checks that the database's
    extension is recent enough (:class:`ExtensionVersionError`).
    """
    # }
    # sync {
    # """Idempotency-Key semantics for synchronous code over a ``ConnectionPool``.
    #
    # Claims run on ``claim_pool``, each attempt keeping the connection that
    # claimed checked out until it finishes or aborts, and running its
    # ``finish``, ``abort`` and ``checkpoint`` there (README, "When a worker
    # dies": a ``'session'`` claim lapses when that session ends, so no idle
    # timeout, ``max_lifetime`` or other call may close it meanwhile).  A
    # waiting idem_begin holds its connection until the first attempt
    # finishes (docs/applications.md, "From an application"), which it does on its own
    # connection, so waiters never hold up a finish.  Pass a ``claim_pool``,
    # or the coordinator makes one from ``pool``'s connection settings, of
    # ``claim_pool_size`` connections (default: ``pool.max_size``), opened on
    # first use and closed by :meth:`close` (or ``async with coordinator``).
    # It needs a connection per running attempt and per waiting duplicate.
    # ``pool`` serves calls on a claim whose connection was let go.
    #
    # ``lease``, ``ttl`` and (extension 1.4) ``takeover``, ``remember`` are
    # passed to every idem_begin when given; ``None`` (the default) sends NULL,
    # so the server's settings apply (``idempotency.lease``, ...).  Durations
    # are ``timedelta``, seconds (``int``, ``float``) or an interval's text;
    # ``in_flight`` and ``takeover`` are taken in any case.  ``prepare``
    # is psycopg's ``execute(prepare=)``: ``None`` prepares a statement after
    # it has run a few times on a connection.
    #
    # ``wait_timeout`` (a ``timedelta`` or seconds) bounds how long a claim
    # waits for another attempt holding the key: then it raises
    # :class:`WaitTimeoutError` (an :class:`InProgressError`).
    # ``on_outcome(operation, outcome)`` is called once per claim with its
    # outcome (``_core.OUTCOMES``: ``"new"``, ``"replay"``, ``"recover"``,
    # ``"in_progress"``, ``"key_reuse"``, ``"expired"``, ``"store_error"``),
    # e.g. to count them; each is also logged at debug level (logger
    # ``idempotency_pg``).  The first call checks that the database's
    # extension is recent enough (:class:`ExtensionVersionError`).
    # """
    # }

    def __init__(self, pool: AsyncConnectionPool, *, in_flight: str = "wait",
                 lease: _core.Duration = None, ttl: _core.Duration = None,
                 takeover: str | None = None, remember: _core.Duration = None,
                 wait_timeout: _core.Duration = None, on_outcome: _core.OutcomeHook | None = None,
                 claim_pool: AsyncConnectionPool | None = None,
                 claim_pool_size: int | None = None, prepare: bool | None = None) -> None:
        if claim_pool is pool:
            raise ValueError("claim_pool must be another pool than pool (README, \"From an application\")")
        self.pool = pool
        self.settings = _core.Settings.make(in_flight, lease, ttl, takeover, remember)
        self.wait_timeout = _core.wait_duration(wait_timeout)
        self.on_outcome = on_outcome
        self._version_checked = False
        self.prepare = prepare
        self._claim_pool = claim_pool
        self._own_claim_pool: AsyncConnectionPool | None = None
        self._claim_pool_size = claim_pool_size
        self._opening = asyncio.Lock()  # sync: self._opening = threading.Lock()
        self._begin_sql: LiteralString = self.settings.begin_sql()

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
        if self._claim_pool is not None:
            return self._claim_pool
        async with self._opening:
            if self._own_claim_pool is None:
                p = self.pool
                own = AsyncConnectionPool(
                    p.conninfo, kwargs={**(cast(dict[str, Any] | None, p.kwargs) or {}), "autocommit": True},
                    connection_class=p.connection_class, min_size=1,
                    max_size=self._claim_pool_size or p.max_size, timeout=p.timeout,
                    name=f"{p.name}.claims", open=False)
                await own.open()
                self._own_claim_pool = own
            return self._own_claim_pool

    def _report(self, operation: str, key: str, outcome: str) -> None:
        _core.report(self.on_outcome, operation, key, outcome)

    def _refused(self, operation: str, key: str, err: IdempotencyError) -> None:
        """An error of idem_begin: tagged with the claim, and reported."""
        err.operation, err.key = operation, key
        outcome = _core.outcome_of_error(err)
        if outcome is not None:
            self._report(operation, key, outcome)

    async def _check_version(self, conn: AsyncConnection[Any] | None = None) -> None:
        """At the first call: the database's extension has the API this
        package needs (:class:`ExtensionVersionError`).  Checked again at
        the next call while it fails, so an ``ALTER EXTENSION ... UPDATE``
        needs no restart."""
        if self._version_checked:
            return
        if conn is not None:
            row = await _version_on(conn, _execute)
        else:
            row = await self._read_version()
        _core.check_version(*row)
        self._version_checked = True

    async def _read_version(self) -> tuple[str | None, bool]:
        """The version query on a connection of ``pool``; a connection the
        server ended (a restart before the first call) is replaced as the
        claims replace theirs: once more on another one, up to the pool's
        size, then on a new connection."""
        for _ in range(self.pool.max_size):
            async with self.pool.connection() as conn:
                try:
                    return await _version_on(conn, _autocommit_on)
                except psycopg.Error as err:
                    if not _core.lost_connection(conn, err):
                        raise
                    log.warning("connection lost checking the extension's version (%s): "
                                "checking on another one", err)
        conn = await _connect(self.pool)
        try:
            return await _version_on(conn, _execute)
        finally:
            await conn.close()

    async def inspect(self, operation: str, key: str) -> Record | None:
        """``idem_inspect``: the calling role's record of the key (``None``:
        none), with the time left of a pending claim's lease."""
        async with self.pool.connection() as conn:
            with db_errors():
                cur = await conn.execute(RECORD_SQL, {"operation": operation, "key": key}, prepare=False)
                row = await cur.fetchone()
            if not conn.autocommit:
                await conn.rollback()
        return None if row is None else Record(*row)

    async def begin(self, operation: str, key: str, fingerprint: bytes | None, *,
                    wait_timeout: _core.Duration = None) -> AsyncClaim:
        """``idem_begin`` in autocommit, the external-call shape: the claim is
        committed when this returns.  A ``'new'`` or ``'recover'`` claim keeps
        its connection checked out of the claim pool: end it with ``finish``
        or ``abort`` (or ``abandon`` to leave it pending); a ``'replay'``'s
        connection is back in its pool.

        Raises :class:`InProgressError` (IK409), :class:`KeyReuseError`
        (IK422), :class:`ResponseExpiredError` (IK410),
        :class:`InvalidRequestError`; a wait longer than ``wait_timeout``
        (this argument, else the coordinator's) raises
        :class:`WaitTimeoutError`; one cut short by a ``statement_timeout``
        of the connection's raises psycopg's ``QueryCanceled``."""
        wait = _core.wait_duration(wait_timeout) or self.wait_timeout
        return await self._begin(operation, key, fingerprint, self.settings, wait)

    async def _begin(self, operation: str, key: str, fingerprint: bytes | None, settings: Settings,
                     wait_timeout: timedelta | None, checkpoint: Jsonb | None = None) -> AsyncClaim:
        await self._check_version()
        try:
            claim = await self._claim(operation, key, fingerprint, settings, wait_timeout, checkpoint)
        except IdempotencyError as err:
            self._refused(operation, key, err)
            raise
        self._report(operation, key, str(claim.status))
        return claim

    async def _claim(self, operation: str, key: str, fingerprint: bytes | None, settings: Settings,
                     wait_timeout: timedelta | None, checkpoint: Jsonb | None) -> AsyncClaim:
        """The claim; with ``checkpoint`` (a jsonb parameter), its statement records it
        on a new claim."""
        claim = AsyncClaim(self, operation, key, fingerprint)
        pool = await self._claims()
        params = settings.begin_params(operation, key, fingerprint)
        if checkpoint is not None:
            params["checkpoint"] = checkpoint
            sql = settings.begin_sql(checkpoint=True)
        else:
            sql = self._begin_sql if settings == self.settings else settings.begin_sql()
        wait = None if wait_timeout is None else _core.wait_ms(wait_timeout)
        conn, switched = await _checkout(pool)
        lost = 0
        attempt = 1
        while True:
            started = time.monotonic()
            try:
                claim._set(await _execute(conn, sql, params, self.prepare, wait))
                break
            except psycopg.Error as err:
                if _core.lost_connection(conn, err) and lost < pool.max_size:
                    # an idle connection the server ended (a restart, a
                    # terminated backend): once more on another one.  Had the
                    # lost statement claimed, this is a duplicate of it.
                    log.warning("connection lost claiming key %r of %r (%s): claiming on another one",
                                key, operation, err)
                    lost += 1
                    await _checkin(pool, conn, switched, close=True)
                    conn, switched = await _checkout(pool)
                    continue
                if not _core.serialization_retry(err, attempt):
                    await _checkin(pool, conn, switched, close=False)
                    if wait_timeout is not None and _core.statement_timeout(
                            err, time.monotonic() - started, wait_timeout):
                        raise WaitTimeoutError(operation, key, wait_timeout,
                                               detail=_core.error_detail(err)) from err
                    raise
                attempt += 1
            except BaseException:
                # no claim was made (a cancelled call's connection is closed)
                await _checkin(pool, conn, switched, close=False)
                raise
        if claim.token is None:
            await _checkin(pool, conn, switched, close=False)
        else:
            claim._held, claim._held_pool, claim._switched = conn, pool, switched
        return claim

    def claim(self, conn: AsyncConnection[Any], operation: str, key: str,
              fingerprint: bytes | None) -> AsyncClaim:
        # async {
        """The in-transaction shape: ``async with coordinator.claim(conn, ...)
        as c`` runs ``idem_begin`` on ``conn``, in its transaction.  On
        ``c.status == 'new'`` do the effect on ``conn`` and ``await
        c.finish(result)``; on ``'replay'`` use ``c.response``.  Commit (or
        roll back) is the caller's.  An exception out of the block with the
        claim unfinished aborts it if the transaction can still run
        statements.  Raises as :meth:`begin` does."""
        # }
        # sync {
        # """The in-transaction shape: ``async with coordinator.claim(conn, ...)
        # as c`` runs ``idem_begin`` on ``conn``, in its transaction.  On
        # ``c.status == 'new'`` do the effect on ``conn`` and
        # ``c.finish(result)``; on ``'replay'`` use ``c.response``.  Commit (or
        # roll back) is the caller's.  An exception out of the block with the
        # claim unfinished aborts it if the transaction can still run
        # statements.  Raises as :meth:`begin` does."""
        # }
        return AsyncClaim(self, operation, key, fingerprint, conn)

    def idempotent(self, operation: str, *, fingerprint_params: Sequence[str] = (),
                   key_param: str = "idempotency_key", result_type: Any | None = None,
                   recover: Callable[..., Any] | None = None, in_flight: str | None = None,
                   lease: _core.Duration = None, ttl: _core.Duration = None, takeover: str | None = None,
                   remember: _core.Duration = None, wait_timeout: _core.Duration = None,
                   on_store_error: str = "raise"
                   ) -> AsyncDecorator:
        """:func:`idempotent` bound to this coordinator (``coordinator=self``)."""
        return idempotent(operation, coordinator=self, fingerprint_params=fingerprint_params,
                          key_param=key_param, result_type=result_type, recover=recover,
                          in_flight=in_flight, lease=lease, ttl=ttl, takeover=takeover, remember=remember,
                          wait_timeout=wait_timeout, on_store_error=on_store_error)


def idempotent(operation: str, *, coordinator: _core.Binding, fingerprint_params: Sequence[str] = (),
               key_param: str = "idempotency_key", result_type: Any | None = None,
               recover: Callable[..., Any] | None = None, in_flight: str | None = None,
               lease: _core.Duration = None, ttl: _core.Duration = None, takeover: str | None = None,
               remember: _core.Duration = None, wait_timeout: _core.Duration = None,
               on_store_error: str = "raise"
               ) -> AsyncDecorator:
    # async {
    """Decorate an ``async def`` that takes the key as ``key_param``
    (default ``idempotency_key=``).

    ``coordinator`` is an :class:`AsyncCoordinator`, or -- so that the
    function can be decorated where it is defined, before any pool exists --
    the name of the parameter that holds one at the call, with attributes
    (``"self.coordinator"``, ``"coordinator"``), or a callable returning it
    at the call (``lambda: app.state.coordinator``).

    With a key, the function runs once per key (the external-call shape:
    claim, call, finish) and every call returns an equal result: the first
    call's result as stored, restored to the function's return annotation
    (or ``result_type``) by :mod:`idempotency_pg.encoding` -- pydantic
    models, dataclasses, ``datetime``, ``UUID``, ``Decimal``.
    ``fingerprint_params`` names the arguments (or their attributes:
    ``"body.amount"``) that make the request *this* request (values of the
    types :func:`~idempotency_pg.fingerprint` takes).  With key ``None`` the
    function just runs.  An exception in the function aborts the claim and
    is re-raised: errors are not cached.  Inside the function,
    :func:`current_claim` is its claim (for ``checkpoint``).

    ``in_flight``, ``lease``, ``ttl``, ``takeover``, ``remember`` and
    ``wait_timeout`` override the coordinator's for this function
    (durations as ``timedelta`` or seconds).

    ``recover`` (extension 1.4): called as ``recover(state, *args,
    **kwargs)`` (it may be async) when the call took over a claim that
    had a checkpoint; its result is stored as the function's would be.
    Without it such a call raises :class:`RecoveryNeededError` (see below
    for a checkpoint recording a result that was not stored).  Either
    way the claim is not aborted on failure: its checkpoint is kept for
    the next attempt.

    ``on_store_error``: what a call does when the store cannot be reached
    to claim the key (no connection, none in time): ``"raise"`` (the
    default: the call fails, nothing runs unguarded) or ``"run"``: the
    function runs without a claim, which is logged as a warning and
    reported as the outcome ``"store_error"``.

    A result that cannot be stored (not JSON, too large, the connection
    lost twice) raises :class:`ResponseNotStoredError` and is logged as
    an error; the claim is left pending with a checkpoint, so the next
    attempt gets ``'recover'``, never a silent second run.  Without
    ``recover``, the attempt that gets ``'recover'`` with that
    checkpoint completes the key with it and raises
    :class:`ResponseNotStoredError` too, as every later attempt does.

    The wrapper raises what :meth:`AsyncCoordinator.begin` and
    :meth:`AsyncClaim.finish` raise.  ``wrapper.outcome(...)`` returns an
    :class:`Outcome` instead (the value and whether it was a replay)."""
    # }
    # sync {
    # """Decorate a function that takes the key as ``key_param``
    # (default ``idempotency_key=``).
    #
    # ``coordinator`` is an :class:`AsyncCoordinator`, or -- so that the
    # function can be decorated where it is defined, before any pool exists --
    # the name of the parameter that holds one at the call, with attributes
    # (``"self.coordinator"``, ``"coordinator"``), or a callable returning it
    # at the call (``lambda: app.state.coordinator``).
    #
    # With a key, the function runs once per key (the external-call shape:
    # claim, call, finish) and every call returns an equal result: the first
    # call's result as stored, restored to the function's return annotation
    # (or ``result_type``) by :mod:`idempotency_pg.encoding` -- pydantic
    # models, dataclasses, ``datetime``, ``UUID``, ``Decimal``.
    # ``fingerprint_params`` names the arguments (or their attributes:
    # ``"body.amount"``) that make the request *this* request (values of the
    # types :func:`~idempotency_pg.fingerprint` takes).  With key ``None`` the
    # function just runs.  An exception in the function aborts the claim and
    # is re-raised: errors are not cached.  Inside the function,
    # :func:`current_claim` is its claim (for ``checkpoint``).
    #
    # ``in_flight``, ``lease``, ``ttl``, ``takeover``, ``remember`` and
    # ``wait_timeout`` override the coordinator's for this function
    # (durations as ``timedelta`` or seconds).
    #
    # ``recover`` (extension 1.4): called as ``recover(state, *args,
    # **kwargs)`` when the call took over a claim that
    # had a checkpoint; its result is stored as the function's would be.
    # Without it such a call raises :class:`RecoveryNeededError` (see below
    # for a checkpoint recording a result that was not stored).  Either
    # way the claim is not aborted on failure: its checkpoint is kept for
    # the next attempt.
    #
    # ``on_store_error``: what a call does when the store cannot be reached
    # to claim the key (no connection, none in time): ``"raise"`` (the
    # default: the call fails, nothing runs unguarded) or ``"run"``: the
    # function runs without a claim, which is logged as a warning and
    # reported as the outcome ``"store_error"``.
    #
    # A result that cannot be stored (not JSON, too large, the connection
    # lost twice) raises :class:`ResponseNotStoredError` and is logged as
    # an error; the claim is left pending with a checkpoint, so the next
    # attempt gets ``'recover'``, never a silent second run.  Without
    # ``recover``, the attempt that gets ``'recover'`` with that
    # checkpoint completes the key with it and raises
    # :class:`ResponseNotStoredError` too, as every later attempt does.
    #
    # The wrapper raises what :meth:`AsyncCoordinator.begin` and
    # :meth:`AsyncClaim.finish` raise.  ``wrapper.outcome(...)`` returns an
    # :class:`Outcome` instead (the value and whether it was a replay)."""
    # }
    overrides = _core.Overrides.make(in_flight, lease, ttl, takeover, remember, wait_timeout)
    fail_open = _core.policy("on_store_error", on_store_error, ("raise", "run")) == "run"
    path = coordinator if isinstance(coordinator, str) else None

    def decorate(func: Callable[P, Awaitable[R]]) -> AsyncIdempotentFunction[P, R]:  # sync: def decorate(func: Callable[P, R]) -> IdempotentFunction[P, R]:
        # async {
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"{func.__qualname__} is not an async function: use Coordinator (idempotency_pg.sync)")
        # }
        # sync {
        # if inspect.iscoroutinefunction(func):
        #     raise TypeError(f"{func.__qualname__} is an async function: use idempotency_pg.aio.AsyncCoordinator")
        # }
        spec = _core.CallSpec(func, fingerprint_params, key_param, path)
        results = _core.ResultCodec(func, result_type)
        # without recover=, the function's claims refuse checkpoints
        refusal = None if recover is not None else (
            f"{func.__qualname__!r} checkpoints its claim, but was decorated without recover=: the "
            "attempt that takes the key over would get 'recover' and have nothing to answer it "
            "with; pass recover=")

        async def outcome(*args: Any, **kwargs: Any) -> Outcome:
            bound = spec.bind(args, kwargs)
            key = spec.key(bound)
            if key is None:
                return Outcome(await func(*args, **kwargs), False)
            fp = spec.fingerprint(bound)
            c = spec.coordinator(coordinator, bound)
            if not isinstance(c, AsyncCoordinator):
                raise TypeError(f"the coordinator of {func.__qualname__} is a {type(c).__name__}, "
                                "not an AsyncCoordinator")  # sync: "not a Coordinator")
            try:
                claim = await c._begin(operation, key, fp, overrides.apply(c.settings),
                                       overrides.wait_timeout or c.wait_timeout)
            except Exception as err:
                if not (fail_open and await _unreachable(c, err)):
                    raise
                log.warning("the store is unreachable (%s: %s): running %r for key %r without a claim "
                            "(on_store_error=\"run\")", type(err).__name__, err, operation, key)
                c._report(operation, key, "store_error")
                return Outcome(await func(*args, **kwargs), False)
            if claim.status == "replay":
                if _core.is_unstored(claim.response):
                    raise _core.unstored_error(claim, completed=True)
                return Outcome(results.decode(claim.response), True)
            claim._checkpoint_refusal = refusal
            try:
                with _core.running(claim):
                    if claim.status == "recover" and recover is None and _core.is_unstored(claim.response):
                        await _complete_unstored(claim)
                    if claim.status == "recover":
                        result = await _recover(claim, recover, args, kwargs)
                    else:
                        result = await _run_or_abort(claim, func, args, kwargs)
                stored = await _shielded(_store(claim, result))  # sync: stored = _store(claim, result)
            finally:
                # a claim left pending: its connection is closed
                await claim.abandon()
            return Outcome(results.decode(stored), False)

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return (await outcome(*args, **kwargs)).value  # sync: return outcome(*args, **kwargs).value

        wrapper.outcome = outcome  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return cast(AsyncDecorator, decorate)


async def _run_or_abort(claim: AsyncClaim, func: Callable[..., Awaitable[Any]],  # sync: def _run_or_abort(claim: Claim, func: Callable[..., Any],
                        args: tuple[Any, ...], kwargs: Any) -> Any:
    try:
        return await func(*args, **kwargs)
    except BaseException:
        try:
            await claim.abort()
        except Exception:  # the lease (or the session's end) releases it
            log.exception("idem_abort failed for key %r of %r", claim.key, claim.operation)
        raise


async def _recover(claim: AsyncClaim, recover: Callable[..., Any] | None,
                   args: tuple[Any, ...], kwargs: Any) -> Any:
    if recover is None:
        assert claim.token is not None
        raise RecoveryNeededError(claim.operation, claim.key, claim.token, claim.response)
    # async {
    result = recover(claim.response, *args, **kwargs)
    if asyncio.iscoroutine(result):
        result = await result
    return result
    # }
    # sync {
    # return recover(claim.response, *args, **kwargs)
    # }


async def _complete_unstored(claim: AsyncClaim) -> NoReturn:
    """'recover' with the package's own record of a result that was not
    stored, and no ``recover=``: the function ran in an earlier attempt.  The
    key is completed with that record, so that this attempt and every later
    one raise :class:`ResponseNotStoredError`; if even that cannot be
    stored, the record stays the claim's checkpoint for the next attempt."""
    completed = False
    try:
        await claim.finish(claim.response)
        completed = True
    except Exception:
        log.exception("could not complete key %r of %r with its not-stored record", claim.key, claim.operation)
    not_stored = _core.unstored_error(claim, completed=completed)
    log.error("%s", not_stored)
    raise not_stored


# async {
async def _shielded(awaitable: Awaitable[R]) -> R:
    """``awaitable`` run to its end even if the calling task is cancelled
    meanwhile (once the function has run, its result must be stored, or
    recorded as not stored, before the claim's connection is let go); a
    cancellation is raised once it has ended."""
    task = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait([task])      # a cancelled wait leaves the task running
        except asyncio.CancelledError as err:
            cancelled = err
    try:
        return task.result()
    finally:
        if cancelled is not None:
            raise cancelled


# }
async def _store(claim: AsyncClaim, result: Any) -> Any:
    """``claim.finish(result)`` after the function ran.  If the result cannot
    be stored, the claim gets a checkpoint (unless it has one), so that the
    next attempt is told, and the call fails loudly; if the server refuses
    that too, the result is stored in the background."""
    try:
        return await claim.finish(result)
    except LostClaimError:
        log.error("the function of %r ran for key %r, but the claim was taken over before its "
                  "result was stored", claim.operation, claim.key)
        raise
    except Exception as err:
        assert claim.token is not None
        checkpointed = claim.checkpointed
        storing = False
        if not checkpointed:
            unstored = _core.unstored_state(err)
            try:
                await claim._rescue(CHECKPOINT_SQL, claim._params(state=_core.to_json(unstored)))
                checkpointed = claim.checkpointed = True
            except Exception as failed:
                log.exception("idem_checkpoint failed for key %r of %r", claim.key, claim.operation)
                storing = claim._store_later(failed, result, unstored)
        not_stored = ResponseNotStoredError(claim.operation, claim.key, claim.token, result, err,
                                            sqlstate=_core.error_sqlstate(err), detail=_core.error_detail(err),
                                            checkpointed=checkpointed, storing=storing)
        log.error("%s", not_stored)
        raise not_stored from err
