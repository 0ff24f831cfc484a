"""Once the function (or endpoint) has run, its result is stored: a
cancellation during the finish waits for it, and a database that refuses
every write of the key gets it stored in the background, once it takes
it (docs/http.md, "After the handler has run, never a second run")."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from conftest import DEADLINE_S, arun, await_for, new_key, record_state, wait_for
from fastapi import FastAPI
from psycopg import sql
from psycopg_pool import ConnectionPool
from test_async import open_pool

import idempotency_pg as idem
from idempotency_pg.fastapi import idempotent_route

OP = "store.later"
TABLES = ("idem_record", "idem_result")


def record_tables(admin: psycopg.Connection[Any]) -> list[str]:
    """The tables the edition keeps records in (conftest.expire_completed)."""
    return [t for t in TABLES if admin.execute("SELECT to_regclass(%s) IS NOT NULL", (t,)).fetchone() == (True,)]


def refuse_writes(admin: psycopg.Connection[Any], key: str) -> None:
    """From now on, every write of ``key``'s record fails with 25006, as on
    a read-only server (the conformance case's trigger)."""
    admin.execute(sql.SQL(
        "CREATE FUNCTION store_later_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF NEW.key = {} THEN RAISE EXCEPTION 'read-only' USING ERRCODE = 'read_only_sql_transaction';"
        " END IF; RETURN NEW; END $$").format(sql.Literal(key)))
    for table in record_tables(admin):
        admin.execute(sql.SQL("CREATE TRIGGER store_later_refuse BEFORE INSERT OR UPDATE ON {} FOR EACH ROW"
                              " EXECUTE FUNCTION store_later_refuse()").format(sql.Identifier(table)))


@contextlib.contextmanager
def writes_refused(admin: psycopg.Connection[Any]) -> Iterator[None]:
    """Writes pass again at the end of the block (the trigger is dropped)."""
    try:
        yield
    finally:
        admin.execute("DROP FUNCTION IF EXISTS store_later_refuse() CASCADE")


def test_async_result_stored_later(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    ran: list[str] = []

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool, takeover="session") as c:
            @c.idempotent(OP + ".async")
            async def charge(amount: int, *, idempotency_key: str | None) -> dict[str, int]:
                ran.append("charge")
                refuse_writes(admin, key)
                return {"charged": amount}

            key = new_key("async")
            with writes_refused(admin):
                with pytest.raises(idem.ResponseNotStoredError) as info:
                    await charge(42, idempotency_key=key)
                assert info.value.storing and not info.value.checkpointed
                await asyncio.sleep(0.3)        # rounds refused meanwhile
                assert record_state(admin, OP + ".async", key) == "pending"
            await await_for("the result stored", lambda: record_state(admin, OP + ".async", key) == "completed")
            assert await charge.outcome(42, idempotency_key=key) == idem.Outcome({"charged": 42}, True)
        assert ran == ["charge"]
    arun(main())


def test_sync_result_stored_later(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    ran: list[str] = []
    with ConnectionPool("", min_size=1, max_size=2) as pool, idem.Coordinator(pool, takeover="session") as c:
        @c.idempotent(OP + ".sync")
        def charge(amount: int, *, idempotency_key: str | None) -> dict[str, int]:
            ran.append("charge")
            refuse_writes(admin, key)
            return {"charged": amount}

        key = new_key("sync")
        with writes_refused(admin):
            with pytest.raises(idem.ResponseNotStoredError) as info:
                charge(42, idempotency_key=key)
            assert info.value.storing
        wait_for("the result stored", lambda: record_state(admin, OP + ".sync", key) == "completed")
        assert charge.outcome(42, idempotency_key=key) == idem.Outcome({"charged": 42}, True)
    assert ran == ["charge"]


async def lock_records(conn: psycopg.AsyncConnection[Any], admin: psycopg.Connection[Any]) -> None:
    """Hold up every finish until ``conn`` ends its transaction."""
    for table in record_tables(admin):
        await conn.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(sql.Identifier(table)))


def finish_blocked(admin: psycopg.Connection[Any]) -> bool:
    """Is a statement waiting for :func:`lock_records`' locks?  Once the
    function has returned, the only one is its finish."""
    row = admin.execute("SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND locktype = 'relation'"
                        " AND relation = ANY (%s::regclass[]))", (record_tables(admin),)).fetchone()
    return row == (True,)


#: time for a cancellation to reach the task it cancels (a few turns of the
#: event loop, no I/O): the tests cancel while the finish waits for a lock
#: that only they release, so nothing else depends on the clock
DELIVERED_S = 0.1


def test_async_cancelled_during_the_finish(admin: psycopg.Connection[Any]) -> None:
    """A caller's timeout that cancels the call while its result is stored
    waits for the finish: the next call replays, the function ran once."""
    ran: list[str] = []

    async def main() -> None:
        running, returning = asyncio.Event(), asyncio.Event()
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool, takeover="session") as c, \
                await psycopg.AsyncConnection.connect("") as locker:
            @c.idempotent(OP + ".cancel")
            async def charge(amount: int, *, idempotency_key: str | None) -> dict[str, int]:
                ran.append("charge")
                running.set()
                await returning.wait()
                return {"charged": amount}

            key = new_key("cancel")
            call = asyncio.ensure_future(charge(42, idempotency_key=key))
            await running.wait()
            await lock_records(locker, admin)
            returning.set()
            await await_for("the finish to wait for the lock", lambda: finish_blocked(admin))
            call.cancel()                       # the caller's timeout fires during the finish
            await asyncio.sleep(DELIVERED_S)
            assert not call.done(), "the cancelled call waits for its finish"
            await locker.rollback()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert await charge.outcome(42, idempotency_key=key) == idem.Outcome({"charged": 42}, True)
        assert ran == ["charge"]
    arun(main())


def under_timeout(app: FastAPI, fire: asyncio.Event) -> httpx.AsyncClient:
    """A client of ``app`` behind a timeout middleware, as an ASGI server
    may have, whose timeout fires when ``fire`` is set: the request it
    fires for is cancelled, waited for (as asyncio.wait_for does) and
    answered 504; ``fire`` is cleared for the next request."""
    async def timeout(scope: Any, receive: Any, send: Any) -> None:
        request = asyncio.ensure_future(app(scope, receive, send))
        fired = asyncio.ensure_future(fire.wait())
        await asyncio.wait([request, fired], return_when=asyncio.FIRST_COMPLETED)
        fired.cancel()
        if not request.done():
            fire.clear()
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            await send({"type": "http.response.start", "status": 504, "headers": []})
            await send({"type": "http.response.body", "body": b"timeout"})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=timeout), base_url="http://test")


def test_route_cancelled_during_the_finish(admin: psycopg.Connection[Any]) -> None:
    """The same for a FastAPI route under a timeout middleware."""
    ran: list[str] = []

    async def main() -> None:
        running, returning, fire = asyncio.Event(), asyncio.Event(), asyncio.Event()
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool, takeover="session") as c, \
                await psycopg.AsyncConnection.connect("") as locker:
            app = FastAPI()

            @app.post("/charge", status_code=201)
            @idempotent_route(OP + ".route", coordinator=c)
            async def charge(*, idempotency_key: str) -> dict[str, bool]:
                ran.append("charge")
                running.set()
                await returning.wait()
                return {"charged": True}

            key = new_key("route")
            async with under_timeout(app, fire) as client:
                first = asyncio.ensure_future(client.post("/charge", headers={"Idempotency-Key": key}))
                await running.wait()
                await lock_records(locker, admin)
                returning.set()
                await await_for("the finish to wait for the lock", lambda: finish_blocked(admin))
                fire.set()
                await asyncio.sleep(DELIVERED_S)
                assert not first.done(), "the cancelled request waits for its finish"
                await locker.rollback()
                assert (await first).status_code == 504
                again = await client.post("/charge", headers={"Idempotency-Key": key})
            assert (again.status_code, again.headers["idempotent-replayed"]) == (201, "true")
        assert ran == ["charge"]
    arun(main())


def test_def_endpoint_cancelled_while_it_runs(admin: psycopg.Connection[Any]) -> None:
    """A def endpoint runs in a thread, which a cancellation cannot stop: a
    timeout while it runs waits for its response, which is stored; the
    retry replays it, and the endpoint ran once."""
    ran: list[str] = []
    running, returning = threading.Event(), threading.Event()

    async def main() -> None:
        fire = asyncio.Event()
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool, takeover="session") as c:
            app = FastAPI()

            @app.post("/charge", status_code=201)
            @idempotent_route(OP + ".def", coordinator=c)
            def charge(*, idempotency_key: str) -> dict[str, bool]:
                running.set()
                assert returning.wait(DEADLINE_S)
                ran.append("charge")
                return {"charged": True}

            key = new_key("def")
            async with under_timeout(app, fire) as client:
                first = asyncio.ensure_future(client.post("/charge", headers={"Idempotency-Key": key}))
                await await_for("the endpoint to run", running.is_set)
                fire.set()                      # the timeout fires while the endpoint runs
                await asyncio.sleep(DELIVERED_S)
                assert not first.done(), "the cancelled request waits for its endpoint"
                returning.set()
                assert (await first).status_code == 504
                again = await client.post("/charge", headers={"Idempotency-Key": key})
            assert (again.status_code, again.headers.get("idempotent-replayed")) == (201, "true"), again
        assert ran == ["charge"]
    arun(main())
