"""An attempt keeps the connection that claimed until it finishes or aborts
(docs/applications.md, "When a worker dies": a claim made with takeover => 'session' lapses
when its session ends).  Counted by how often the decorated function runs,
with real concurrent calls against the real server."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from conftest import arun, await_for, new_key, record_state, wait_for, waiting_claims
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from test_async import Provider as AsyncProvider
from test_async import open_pool
from test_async import service as async_service
from test_sync import Provider, service

import idempotency_pg as idem


def runs(provider: Any, key: str) -> int:
    """How often the decorated function ran for ``key``."""
    return sum(1 for call in provider.calls if call[2] == key)


def test_cancelled_wait_keeps_another_attempts_session_claim(admin: psycopg.Connection[Any],
                                                             needs_1_4: None) -> None:
    """k1 and k2 are claimed in turn through a claim pool of one idle
    connection; a duplicate of k2 waits and is cancelled, which closes its
    connection.  k1's session claim must not end with it: a duplicate of k1
    waits and replays, and each function ran once."""
    async def main() -> None:
        async with await open_pool(2) as pool, \
                idem.AsyncCoordinator(pool, takeover="session", claim_pool_size=4) as coordinator:
            provider = AsyncProvider()
            provider.gate = asyncio.Event()
            charge = async_service(coordinator, provider)
            k1, k2 = new_key("k1"), new_key("k2")
            first = asyncio.ensure_future(charge("o1", 1, idempotency_key=k1))
            await await_for("k1 is at the provider", lambda: len(provider.calls) == 1)
            other = asyncio.ensure_future(charge("o2", 2, idempotency_key=k2))
            await await_for("k2 is at the provider", lambda: len(provider.calls) == 2)
            dup2 = asyncio.ensure_future(charge("o2", 2, idempotency_key=k2))
            await await_for("the duplicate of k2 waits", lambda: waiting_claims(admin) == 1)
            dup2.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dup2
            await await_for("no backend waits any more", lambda: waiting_claims(admin) == 0)
            dup1 = asyncio.ensure_future(charge.outcome("o1", 1, idempotency_key=k1))
            await await_for("the duplicate of k1 waits (or runs k1 again)",
                            lambda: waiting_claims(admin) == 1 or len(provider.calls) == 3)
            provider.gate.set()
            result1, result2, replay = await asyncio.wait_for(asyncio.gather(first, other, dup1), 20)
            assert (runs(provider, k1), runs(provider, k2)) == (1, 1)
            assert replay == idem.Outcome(result1, replayed=True)
    arun(main())


def test_max_lifetime_does_not_end_a_running_claim(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """A claim pool whose connections outlive their max_lifetime at once:
    the pool closes a connection when it comes back, so it must not come
    back while its session holds a running claim."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            ConnectionPool("", min_size=1, max_size=3, timeout=10, max_lifetime=0.001,
                           kwargs={"autocommit": True}, open=True) as claims, \
            idem.Coordinator(pool, claim_pool=claims, takeover="session") as coordinator, \
            ThreadPoolExecutor(2) as threads:
        provider = Provider()
        provider.gate.clear()
        charge = service(coordinator, provider)
        key = new_key("lifetime")
        first = threads.submit(charge, "o1", 10, idempotency_key=key)
        wait_for("the first call is at the provider", lambda: len(provider.calls) == 1)
        dup = threads.submit(charge.outcome, "o1", 10, idempotency_key=key)
        wait_for("the duplicate waits (or runs again)",
                 lambda: waiting_claims(admin) == 1 or len(provider.calls) == 2)
        provider.gate.set()
        result = first.result(20)
        assert dup.result(20) == idem.Outcome(result, replayed=True)
        assert runs(provider, key) == 1


def test_max_lifetime_async(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """The same with AsyncCoordinator."""
    async def main() -> None:
        claims = AsyncConnectionPool("", min_size=1, max_size=3, timeout=10, max_lifetime=0.001,
                                     kwargs={"autocommit": True}, open=False)
        await claims.open(wait=True)
        async with await open_pool(2) as pool, claims, \
                idem.AsyncCoordinator(pool, claim_pool=claims, takeover="session") as coordinator:
            provider = AsyncProvider()
            provider.gate = asyncio.Event()
            charge = async_service(coordinator, provider)
            key = new_key("lifetime-async")
            first = asyncio.ensure_future(charge("o1", 10, idempotency_key=key))
            await await_for("the first call is at the provider", lambda: len(provider.calls) == 1)
            dup = asyncio.ensure_future(charge.outcome("o1", 10, idempotency_key=key))
            await await_for("the duplicate waits (or runs again)",
                            lambda: waiting_claims(admin) == 1 or len(provider.calls) == 2)
            provider.gate.set()
            result, replay = await asyncio.wait_for(asyncio.gather(first, dup), 20)
            assert replay == idem.Outcome(result, replayed=True)
            assert runs(provider, key) == 1
    arun(main())


def test_begin_keeps_its_connection_until_the_claim_ends(admin: psycopg.Connection[Any]) -> None:
    """coordinator.begin: a 'new' claim keeps its connection checked out of
    the claim pool until finish (then it goes back), a replay's goes back at once."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            ConnectionPool("", min_size=2, max_size=2, timeout=10, open=False) as claims, \
            idem.Coordinator(pool, claim_pool=claims) as coordinator:
        claims.open(wait=True)
        key = new_key("held")
        claim = coordinator.begin("op.held", key, idem.fingerprint())
        assert claims.get_stats()["pool_available"] == 1
        assert claim.finish({"done": True}) == {"done": True}
        assert claims.get_stats()["pool_available"] == 2
        replay = coordinator.begin("op.held", key, idem.fingerprint())
        assert (replay.status, claims.get_stats()["pool_available"]) == ("replay", 2)
        left = new_key("held")
        coordinator.begin("op.held", left, idem.fingerprint()).abandon()
        assert record_state(admin, "op.held", left) == "pending"
