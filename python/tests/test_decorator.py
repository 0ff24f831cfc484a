"""The free decorator (idempotency_pg.idempotent), bound to its coordinator
at the call; its options (key_param, durations, wait_timeout,
on_store_error); the outcomes it reports; the version check.  Against the
real server, with real concurrent calls."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from conftest import INSTALL, arun, await_for, expire_completed, install_edition, new_key, record_state, wait_for
from psycopg import sql
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from test_async import open_pool

import idempotency_pg as idem

OP = "op.free"


#: the lease of the claim of each running call, as the server has it
LEASES: dict[str, timedelta] = {}
ADMIN: list[psycopg.Connection[Any]] = []


def note_lease(key: str) -> None:
    row = ADMIN[0].execute("SELECT lease_until - created_at FROM idem_inspect(%s::text, %s::text)",
                           (OP, key)).fetchone()
    assert row is not None
    LEASES[key] = row[0]


@pytest.fixture(autouse=True)
def admin_for_leases(admin: psycopg.Connection[Any]) -> Iterator[None]:
    ADMIN[:] = [admin]
    yield


class Service:
    """A service that gets its coordinator at application start; its method
    is decorated when the class is defined, before any pool exists."""

    def __init__(self, coordinator: idem.AsyncCoordinator) -> None:
        self.coordinator = coordinator
        self.calls: list[str] = []

    @idem.idempotent(OP, coordinator="self.coordinator", fingerprint_params=("order_id",),
                     key_param="request_key", lease=timedelta(seconds=20))
    async def charge(self, order_id: str, *, request_key: str | None) -> dict[str, Any]:
        self.calls.append(order_id)
        note_lease(str(request_key))
        return {"order": order_id, "n": len(self.calls)}


@idem.idempotent(OP, coordinator="coordinator", fingerprint_params=("amount",))
async def by_parameter(amount: int, *, coordinator: idem.AsyncCoordinator, idempotency_key: str) -> int:
    return amount * 2


HOLDER: dict[str, idem.Coordinator] = {}


@idem.idempotent(OP, coordinator=lambda: HOLDER["coordinator"], fingerprint_params=("amount",),
                 lease=20, ttl=5400, remember=timedelta(days=2))
def by_callable(amount: int, *, idempotency_key: str) -> int:
    note_lease(idempotency_key)
    return amount + 1


def spans(admin: psycopg.Connection[Any], key: str) -> tuple[Any, ...]:
    row = admin.execute("SELECT expires_at - completed_at, remembered_until - completed_at"
                        "  FROM idem_inspect(%s::text, %s::text)", (OP, key)).fetchone()
    assert row is not None
    return tuple(row)


def near(span: timedelta, expected: timedelta) -> bool:
    return abs(span - expected) < timedelta(seconds=1)


def test_bound_by_attribute_and_parameter(admin: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            service = Service(coordinator)
            key = new_key("self")
            first = await service.charge("o1", request_key=key)
            assert await service.charge("o1", request_key=key) == first == {"order": "o1", "n": 1}
            assert service.calls == ["o1"]
            assert near(LEASES[key], timedelta(seconds=20)), "the decorator's lease"
            with pytest.raises(idem.KeyReuseError):
                await service.charge("o2", request_key=key)
            # outcome, through the class (a function's attribute is not bound)
            again = await Service.charge.outcome(service, "o1", request_key=key)  # type: ignore[attr-defined]
            assert again == idem.Outcome(first, replayed=True)
            # a parameter holds the coordinator
            key2 = new_key("param")
            assert await by_parameter(21, coordinator=coordinator, idempotency_key=key2) == 42
            assert record_state(admin, OP, key2) == "completed"
            with pytest.raises(TypeError, match="not an AsyncCoordinator"):
                await by_parameter(1, coordinator="nope", idempotency_key=new_key("bad"))  # type: ignore[arg-type]
    arun(main())


def test_sync_bound_by_callable_with_durations(admin: psycopg.Connection[Any]) -> None:
    """The sync decorator; lease and ttl in seconds, remember a timedelta."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool) as coordinator:
        HOLDER["coordinator"] = coordinator
        key = new_key("callable")
        assert by_callable(1, idempotency_key=key) == 2
        assert by_callable.outcome(1, idempotency_key=key) == idem.Outcome(2, replayed=True)
        ttl, remember = spans(admin, key)
        assert near(LEASES[key], timedelta(seconds=20)) and ttl == timedelta(seconds=5400)
        assert remember == timedelta(days=2)


def test_bad_options_fail_at_decoration() -> None:
    with pytest.raises(TypeError, match="must take an request_key= argument"):
        @idem.idempotent(OP, coordinator="c", key_param="request_key")
        async def no_key(*, c: Any, idempotency_key: str) -> None: ...
    with pytest.raises(TypeError, match="does not name a parameter"):
        @idem.idempotent(OP, coordinator="self.coordinator", key_param="k")
        def no_self(*, k: str) -> None: ...
    with pytest.raises(ValueError, match="on_store_error"):
        idem.idempotent(OP, coordinator="c", on_store_error="ignore")
    with pytest.raises(TypeError, match="lease must be"):
        idem.idempotent(OP, coordinator="c", lease=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wait_timeout must be positive"):
        idem.idempotent(OP, coordinator="c", wait_timeout=0)


def test_wait_timeout_async(admin: psycopg.Connection[Any]) -> None:
    """A duplicate that waits longer than wait_timeout gets WaitTimeoutError
    (an InProgressError with the key), not QueryCanceled; the first attempt
    is untouched and the next duplicate replays."""
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            gate = asyncio.Event()
            runs: list[int] = []

            @coordinator.idempotent(OP, wait_timeout=timedelta(milliseconds=200))
            async def slow(*, idempotency_key: str) -> int:
                runs.append(1)
                await gate.wait()
                return 7

            key = new_key("wait-timeout")
            first = asyncio.ensure_future(slow(idempotency_key=key))
            await await_for("the first call runs", lambda: len(runs) == 1)
            with pytest.raises(idem.WaitTimeoutError) as info:
                await slow(idempotency_key=key)
            err = info.value
            assert isinstance(err, idem.InProgressError) and err.sqlstate == "57014"
            assert (err.operation, err.key, err.wait_timeout) == (OP, key, timedelta(milliseconds=200))
            assert key in str(err) and isinstance(err.__cause__, psycopg.errors.QueryCanceled)
            assert record_state(admin, OP, key) == "pending"
            gate.set()
            assert await first == 7
            assert await slow.outcome(idempotency_key=key) == idem.Outcome(7, replayed=True)
            assert runs == [1]
            # the claim pool's connections keep their own statement_timeout
            async with (await coordinator._claims()).connection() as conn:
                cur = await conn.execute("SHOW statement_timeout")
                assert await cur.fetchone() == ("0",)
    arun(main())


def test_wait_timeout_sync(admin: psycopg.Connection[Any]) -> None:
    """The coordinator's wait_timeout, for Coordinator.begin."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool, wait_timeout=0.2) as coordinator:
        key = new_key("wait-timeout-sync")
        held = coordinator.begin(OP, key, idem.fingerprint())
        with pytest.raises(idem.WaitTimeoutError) as info:
            coordinator.begin(OP, key, idem.fingerprint())
        assert info.value.key == key
        held.finish({"done": True})
        assert coordinator.begin(OP, key, idem.fingerprint()).status == "replay"


UNREACHABLE = "host=/nonexistent-idempotency-test-socket-dir port=1 connect_timeout=1"


def test_unreachable_store_closed_by_default_and_fail_open(caplog: pytest.LogCaptureFixture) -> None:
    """No connection to the store: the call raises (default), or, with
    on_store_error="run", runs unguarded, logged and reported."""
    seen: list[tuple[str, str]] = []

    async def main() -> None:
        pool = AsyncConnectionPool(UNREACHABLE, min_size=1, max_size=1, timeout=0.5, open=False,
                                   reconnect_timeout=0.5)
        await pool.open(wait=False)
        try:
            async with idem.AsyncCoordinator(pool, on_outcome=lambda op, o: seen.append((op, o))) as c:
                runs: list[str] = []

                @idem.idempotent("payment.charge", coordinator=c)
                async def closed(*, idempotency_key: str) -> str:
                    runs.append("closed")
                    return "charged"

                @idem.idempotent("report.send", coordinator=c, on_store_error="run")
                async def open_(*, idempotency_key: str) -> str:
                    runs.append("open")
                    return "sent"

                with pytest.raises(Exception) as info:
                    await closed(idempotency_key=new_key("closed"))
                assert idem._core.store_unreachable(info.value), info.value
                key = new_key("open")
                with caplog.at_level(logging.WARNING, logger="idempotency_pg"):
                    assert await open_.outcome(idempotency_key=key) == idem.Outcome("sent", False)
                assert runs == ["open"]
                assert seen == [("report.send", "store_error")]
                assert any(r.levelno == logging.WARNING and key in r.getMessage() for r in caplog.records)
        finally:
            await pool.close()
    arun(main())


def test_outcomes_are_logged_and_reported(admin: psycopg.Connection[Any], needs_1_4: None,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """new, replay, key_reuse, in_progress, expired (IK410), recover: each
    logged at debug level with the key, and passed to on_outcome."""
    seen: list[tuple[str, str]] = []
    caplog.set_level(logging.DEBUG, logger="idempotency_pg")
    with ConnectionPool("", min_size=1, max_size=3, timeout=10, open=True) as pool, \
            idem.Coordinator(pool, in_flight="raise", remember=timedelta(days=30), takeover="session",
                             on_outcome=lambda op, o: seen.append((op, o))) as coordinator:
        gate = threading.Event()
        started = threading.Event()

        @coordinator.idempotent(OP, fingerprint_params=("n",), recover=lambda state, n, **_: n)
        def act(n: int, *, idempotency_key: str) -> int:
            if n == 0:
                started.set()
                assert gate.wait(30)
            return n

        key = new_key("outcomes")
        act(1, idempotency_key=key)
        act(1, idempotency_key=key)
        with pytest.raises(idem.KeyReuseError):
            act(2, idempotency_key=key)
        busy = new_key("busy")
        with ThreadPoolExecutor(1) as ex:
            first = ex.submit(act, 0, idempotency_key=busy)
            assert started.wait(30)
            with pytest.raises(idem.InProgressError) as info:
                act(0, idempotency_key=busy)
            assert info.value.key == busy and info.value.operation == OP
            gate.set()
            assert first.result(30) == 0
        # the stage moves the completed record past its ttl, as test/demo does
        expire_completed(admin, key)
        with pytest.raises(idem.ResponseExpiredError):
            act(1, idempotency_key=key)
        lost = new_key("lost")
        dead = coordinator.begin(OP, lost, idem.fingerprint(5))
        dead.checkpoint({"step": 1})
        dead.abandon()  # its backend exits a moment after the connection closes
        wait_for("the claim lapses", lambda: record_state(admin, OP, lost) == "lapsed")
        assert act(5, idempotency_key=lost) == 5
    assert seen == [(OP, "new"), (OP, "replay"), (OP, "key_reuse"), (OP, "new"), (OP, "in_progress"),
                    (OP, "expired"), (OP, "new"), (OP, "recover")]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    for k, outcome in ((key, "new"), (key, "replay"), (key, "key_reuse"), (busy, "in_progress"),
                       (key, "expired"), (lost, "recover")):
        assert any(repr(k) in m and m.endswith(outcome) for m in logged), (k, outcome)


@pytest.fixture
def scratch_db(admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A database of its own (the extension, if any, is the test's to create)."""
    name = f"idem_py_version_{uuid.uuid4().hex[:12]}"
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_version_check(scratch_db: str) -> None:
    """The first call fails clearly when the extension is missing or older
    than 1.4; it is checked again until it passes (an update needs no restart).
    The portable edition has no version before 1.6 (docs/managed-postgresql.md,
    "versions"): there, installing it is what makes the next call pass."""
    # the sessions' search_path names the schema of the portable edition's
    # psql script before there is one (the database's, which the script
    # sets, is read at a session's start only)
    with psycopg.connect(dbname=scratch_db, autocommit=True) as db, \
            ConnectionPool(f"dbname={scratch_db} options='-c search_path=public,idempotency'", min_size=1,
                           max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool) as coordinator:
        with pytest.raises(idem.ExtensionVersionError, match="not installed") as info:
            coordinator.begin(OP, new_key("v"), idem.fingerprint())
        assert info.value.installed is None and info.value.required == (1, 4)
        if INSTALL is not None:
            install_edition(f"dbname={scratch_db}")
            claim = coordinator.begin(OP, new_key("v"), idem.fingerprint())
            assert claim.status == "new"
            claim.abort()
            return
        db.execute("CREATE EXTENSION idempotency VERSION '1.3'")
        with pytest.raises(idem.ExtensionVersionError, match="version 1.3; idempotency_pg needs 1.4") as info:
            coordinator.begin(OP, new_key("v"), idem.fingerprint())
        assert info.value.installed == "1.3"
        with pool.connection() as conn, pytest.raises(idem.ExtensionVersionError):
            with coordinator.claim(conn, OP, new_key("v"), idem.fingerprint()):
                pass
        db.execute("ALTER EXTENSION idempotency UPDATE")
        claim = coordinator.begin(OP, new_key("v"), idem.fingerprint())
        assert claim.status == "new"
        claim.abort()


def test_version_of_a_schema_install(scratch_db: str) -> None:
    """Without an extension (the portable edition's psql script installs it
    into a schema, with no pg_extension row), the version is what the
    idem_portable_version() on the search_path answers: here a stand-in's."""
    with psycopg.connect(dbname=scratch_db, autocommit=True) as db, \
            ConnectionPool(f"dbname={scratch_db} options='-c search_path=stand_in'", min_size=1, max_size=2,
                           timeout=10, open=True) as pool, \
            idem.Coordinator(pool) as coordinator:
        db.execute("CREATE SCHEMA stand_in")
        db.execute("CREATE FUNCTION stand_in.idem_portable_version() RETURNS text LANGUAGE sql"
                   " AS $$ SELECT '1.3' $$")
        with pytest.raises(idem.ExtensionVersionError, match="version 1.3; .* newer idempotency--schema.sql") as info:
            coordinator.begin(OP, new_key("v"), idem.fingerprint())
        assert info.value.installed == "1.3" and info.value.schema
        db.execute("CREATE OR REPLACE FUNCTION stand_in.idem_portable_version() RETURNS text LANGUAGE sql"
                   " AS $$ SELECT '1.6' $$")
        # the check passes: the call goes on to idem_begin, which the stand-in lacks
        with pytest.raises(psycopg.errors.UndefinedFunction, match="idem_begin"):
            coordinator.begin(OP, new_key("v"), idem.fingerprint())
