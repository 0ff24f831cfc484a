"""When the store is busy or restarts: a pool with no connection free in
time is not an unreachable store (``on_store_error="run"`` does not run a
duplicate unguarded), and a server restarted before a coordinator's first
call costs no request an error (the version check replaces a lost
connection as the claims do)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from conftest import Server, arun, await_for, new_key
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

import idempotency_pg as idem

OP = "op.availability"


def test_pool_timeout_does_not_fail_open(admin: psycopg.Connection[Any]) -> None:
    """A claim pool of one connection, held by the first attempt: the
    duplicate gets no connection in time.  The store answers, so it must not
    run unguarded while the first attempt still runs: it raises."""
    async def main() -> None:
        pool = AsyncConnectionPool("", min_size=1, max_size=1, timeout=0.5, open=False)
        await pool.open(wait=True)
        async with pool, idem.AsyncCoordinator(pool, claim_pool_size=1) as c:
            gate, ran = asyncio.Event(), []

            @idem.idempotent(OP, coordinator=c, on_store_error="run")
            async def act(*, idempotency_key: str) -> str:
                ran.append(idempotency_key)
                if len(ran) == 1:       # a second run does not wait: the test fails, not hangs
                    await gate.wait()
                return "done"

            key = new_key("busy")
            first = asyncio.ensure_future(act(idempotency_key=key))
            await await_for("the first attempt runs", lambda: ran == [key])
            with pytest.raises(PoolTimeout):
                await act(idempotency_key=key)
            assert ran == [key], "the duplicate ran unguarded"
            gate.set()
            assert await first == "done"
            assert await act.outcome(idempotency_key=key) == idem.Outcome("done", True)
            assert ran == [key]
    arun(main())


def test_restart_before_the_first_call_async(own_server: Server) -> None:
    """The pool's connections are ended by a restart before the
    coordinator's first call: every call is answered, none fails."""
    async def main() -> None:
        pool = AsyncConnectionPool(own_server.conninfo, min_size=4, max_size=4, timeout=10, open=False)
        await pool.open(wait=True)
        async with pool, idem.AsyncCoordinator(pool, claim_pool_size=4) as c:
            own_server.restart()
            ran: list[str] = []

            @idem.idempotent(OP, coordinator=c)
            async def act(*, idempotency_key: str) -> str:
                ran.append(idempotency_key)
                return idempotency_key

            keys = [new_key("restart") for _ in range(6)]
            for key in keys:
                assert await act(idempotency_key=key) == key
            assert ran == keys
    arun(main())


def test_restart_before_the_first_call_sync(own_server: Server) -> None:
    with ConnectionPool(own_server.conninfo, min_size=4, max_size=4, timeout=10, open=True) as pool:
        pool.wait()
        with idem.Coordinator(pool, claim_pool_size=4) as c:
            own_server.restart()
            ran: list[str] = []

            @idem.idempotent(OP, coordinator=c)
            def act(*, idempotency_key: str) -> str:
                ran.append(idempotency_key)
                return idempotency_key

            keys = [new_key("restart-sync") for _ in range(6)]
            for key in keys:
                assert act(idempotency_key=key) == key
            assert ran == keys
