"""AsyncCoordinator against the real server: the decorator (the external-call
shape) and claim(conn, ...) (the in-transaction shape)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from conftest import arun, await_for, new_key, record_state, waiting_claims
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import idempotency_pg as idem

OP = "payment.charge"


class Charge(BaseModel):
    id: str
    amount: int


async def open_pool(size: int) -> AsyncConnectionPool:
    pool = AsyncConnectionPool("", min_size=size, max_size=size, timeout=10, open=False)
    await pool.open(wait=True)
    return pool


class Provider:
    """A stand-in for the external call: counts its calls; ``gate`` (if set)
    holds each call until the test opens it."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.gate: asyncio.Event | None = None
        self.fail_next = False

    async def charge(self, order_id: str, amount: int, key: str) -> dict[str, Any]:
        self.calls.append((order_id, amount, key))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("provider timed out")
        return {"id": f"ch_{len(self.calls)}", "amount": amount}


def service(coordinator: idem.AsyncCoordinator, provider: Provider, **options: Any) -> Any:
    """The seed article's example, with this package."""
    @coordinator.idempotent(operation=OP, fingerprint_params=("order_id", "amount"), **options)
    async def charge(order_id: str, amount: int, *, idempotency_key: "str | None") -> Any:
        return await provider.charge(order_id, amount, idempotency_key or "")
    return charge


def test_runs_once_and_replays(admin: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            provider = Provider()
            charge = service(coordinator, provider)
            key = new_key("once")
            first = await charge("o1", 1000, idempotency_key=key)
            again = await charge.outcome("o1", 1000, idempotency_key=key)
            assert first == {"id": "ch_1", "amount": 1000}
            assert again == idem.Outcome(first, replayed=True)
            assert len(provider.calls) == 1
            assert provider.calls[0][2] == key, "the key is passed on"
            with pytest.raises(idem.KeyReuseError) as reuse:
                await charge("o1", 5, idempotency_key=key)
            assert reuse.value.stored_fingerprint == idem.fingerprint("o1", 1000).hex()
            assert reuse.value.request_fingerprint == idem.fingerprint("o1", 5).hex()
            # no key: no idempotency, the function just runs
            await charge("o1", 1000, idempotency_key=None)
            await charge("o1", 1000, idempotency_key=None)
            assert len(provider.calls) == 3
    arun(main())


def test_result_type_pydantic() -> None:
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            provider = Provider()

            @coordinator.idempotent(operation=OP, fingerprint_params=("amount",), result_type=Charge)
            async def charge(amount: int, *, idempotency_key: str) -> Charge:
                return Charge(**await provider.charge("o", amount, idempotency_key))

            key = new_key("model")
            first = await charge(7, idempotency_key=key)
            replay = await charge(7, idempotency_key=key)
            assert isinstance(first, Charge) and first == replay == Charge(id="ch_1", amount=7)
            assert len(provider.calls) == 1
    arun(main())


def test_exception_aborts_and_is_not_cached(admin: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            provider = Provider()
            charge = service(coordinator, provider)
            key = new_key("flaky")
            provider.fail_next = True
            with pytest.raises(ConnectionError):
                await charge("o2", 4200, idempotency_key=key)
            assert record_state(admin, OP, key) is None, "the claim was aborted"
            result = await charge.outcome("o2", 4200, idempotency_key=key)
            assert result == idem.Outcome({"id": "ch_2", "amount": 4200}, replayed=False)
            assert len(provider.calls) == 2
    arun(main())


@pytest.mark.parametrize("in_flight", ["wait", "raise"])
def test_duplicate_in_flight(admin: psycopg.Connection[Any], in_flight: str) -> None:
    """A duplicate of a running call waits for its result, or gets IK409."""
    async def main() -> None:
        async with await open_pool(2) as pool, \
                idem.AsyncCoordinator(pool, in_flight=in_flight) as coordinator:
            provider = Provider()
            provider.gate = asyncio.Event()
            charge = service(coordinator, provider)
            key = new_key(in_flight)
            first = asyncio.ensure_future(charge("o3", 300, idempotency_key=key))
            await await_for("the first call is at the provider", lambda: len(provider.calls) == 1)
            if in_flight == "raise":
                with pytest.raises(idem.InProgressError):
                    await charge("o3", 300, idempotency_key=key)
                provider.gate.set()
                assert await first == await charge("o3", 300, idempotency_key=key)
            else:
                dup = asyncio.ensure_future(charge.outcome("o3", 300, idempotency_key=key))
                await await_for("the duplicate waits in idem_begin", lambda: waiting_claims(admin) == 1)
                assert not dup.done()
                provider.gate.set()
                assert (await dup) == idem.Outcome(await first, replayed=True)
            assert len(provider.calls) == 1
    arun(main())


def test_pool_exhaustion_n_duplicates_on_a_pool_of_n(admin: psycopg.Connection[Any]) -> None:
    """N duplicates wait while the first call runs, on a pool of N: the first
    call still finishes (on the connection that claimed, which it keeps: the
    claim pool has one per attempt and per waiting duplicate) and wakes them all."""
    n = 3

    async def main() -> None:
        async with await open_pool(n) as pool, idem.AsyncCoordinator(pool, claim_pool_size=n + 1) as coordinator:
            provider = Provider()
            provider.gate = asyncio.Event()
            charge = service(coordinator, provider)
            key = new_key("exhaust")
            first = asyncio.ensure_future(charge("o4", 99, idempotency_key=key))
            await await_for("the first call is at the provider", lambda: len(provider.calls) == 1)
            dups = [asyncio.ensure_future(charge.outcome("o4", 99, idempotency_key=key)) for _ in range(n)]
            await await_for(f"{n} duplicates wait", lambda: waiting_claims(admin) == n)
            provider.gate.set()
            result = await asyncio.wait_for(first, 20)
            outcomes = await asyncio.wait_for(asyncio.gather(*dups), 20)
            assert outcomes == [idem.Outcome(result, replayed=True)] * n
            assert len(provider.calls) == 1
    arun(main())


def test_cancelled_wait_changes_nothing(admin: psycopg.Connection[Any]) -> None:
    """Cancelling a waiting call ends its wait in the server; the first call
    then finishes and a later call replays."""
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            provider = Provider()
            provider.gate = asyncio.Event()
            charge = service(coordinator, provider)
            key = new_key("cancel")
            first = asyncio.ensure_future(charge("o5", 5, idempotency_key=key))
            await await_for("the first call is at the provider", lambda: len(provider.calls) == 1)
            dup = asyncio.ensure_future(charge("o5", 5, idempotency_key=key))
            await await_for("the duplicate waits", lambda: waiting_claims(admin) == 1)
            dup.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dup
            await await_for("no backend waits any more", lambda: waiting_claims(admin) == 0)
            assert record_state(admin, OP, key) == "pending"
            provider.gate.set()
            result = await first
            assert await charge.outcome("o5", 5, idempotency_key=key) == idem.Outcome(result, True)
            assert len(provider.calls) == 1
    arun(main())


def test_in_transaction_shape(admin: psycopg.Connection[Any]) -> None:
    """claim(conn, ...): the claim, the effect and the response commit or
    roll back together; the commit is the caller's."""
    admin.execute("CREATE TABLE IF NOT EXISTS py_orders (key text, amount int)")

    async def place(conn: psycopg.AsyncConnection[Any], coordinator: idem.AsyncCoordinator,
                    key: str, amount: int) -> Any:
        async with coordinator.claim(conn, "order.create", key, idem.fingerprint(amount)) as c:
            if c.status == "replay":
                return c.response
            assert c.status == "new" and c.token is not None
            await conn.execute("INSERT INTO py_orders VALUES (%s::text, %s::int)", (key, amount))
            return await c.finish({"order": key, "amount": amount})

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            key = new_key("tx")
            async with pool.connection() as conn:
                # rolled back: nothing happened, the key is free
                first = await place(conn, coordinator, key, 10)
                await conn.rollback()
                assert record_state(admin, "order.create", key) is None
                # committed: a replay
                first = await place(conn, coordinator, key, 10)
                await conn.commit()
                assert await place(conn, coordinator, key, 10) == first
                await conn.commit()
                # an exception in the block aborts the claim even if the caller commits
                other = new_key("tx-error")
                with pytest.raises(RuntimeError):
                    async with coordinator.claim(conn, "order.create", other, idem.fingerprint(1)):
                        raise RuntimeError("boom")
                await conn.commit()
                assert record_state(admin, "order.create", other) is None
            row = admin.execute("SELECT count(*) FROM py_orders WHERE key = %s::text", (key,)).fetchone()
            assert row == (1,)
    arun(main())


def test_checkpoint_and_recover(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """1.4: a call that checkpointed and died is taken over after its lease:
    the next call gets 'recover' with the state, and the recover= callback's
    result is stored."""
    async def main() -> None:
        async with await open_pool(2) as pool, \
                idem.AsyncCoordinator(pool, lease=timedelta(milliseconds=200)) as coordinator:
            seen: list[Any] = []

            async def resume(state: Any, order_id: str, *, idempotency_key: str) -> Any:
                seen.append(state)
                return {"resumed": state["step"], "order": order_id}

            @coordinator.idempotent(operation="saga", fingerprint_params=("order_id",), recover=resume)
            async def saga(order_id: str, *, idempotency_key: str) -> Any:
                await idem.current_claim().checkpoint({"step": 1})
                return {"done": order_id}

            # a call that checkpoints on the way and completes
            assert await saga("o7", idempotency_key=new_key("saga-ok")) == {"done": "o7"}

            key = new_key("saga")
            # a worker that claims, checkpoints and dies without aborting
            dead = await coordinator.begin("saga", key, idem.fingerprint("o6"))
            await dead.checkpoint({"step": 2})
            await dead.abandon()  # its connection closes
            await await_for("the lease lapses", lambda: record_state(admin, "saga", key) == "lapsed")
            outcome = await saga.outcome("o6", idempotency_key=key)
            assert outcome == idem.Outcome({"resumed": 2, "order": "o6"}, replayed=False)
            assert seen == [{"step": 2}]
            with pytest.raises(idem.LostClaimError):
                await dead.checkpoint({"step": 3})
            assert await saga("o6", idempotency_key=key) == outcome.value

            # without a recover= callback: RecoveryNeededError, the claim is kept
            @coordinator.idempotent(operation="saga")
            async def bare(*, idempotency_key: str) -> Any:
                return "ran"

            key2 = new_key("saga-bare")
            dead = await coordinator.begin("saga", key2, idem.fingerprint())
            await dead.checkpoint({"step": 9})
            await dead.abandon()
            await await_for("the lease lapses", lambda: record_state(admin, "saga", key2) == "lapsed")
            with pytest.raises(idem.RecoveryNeededError) as info:
                await bare(idempotency_key=key2)
            assert info.value.state == {"step": 9} and dead.token is not None and info.value.token > dead.token
            assert record_state(admin, "saga", key2) == "pending"

            # a function decorated without recover= may not checkpoint (the
            # attempt after a takeover would have nothing to answer 'recover'
            # with): TypeError, nothing written, the claim aborted
            @coordinator.idempotent(operation="saga")
            async def careless(*, idempotency_key: str) -> Any:
                await idem.current_claim().checkpoint({"step": 1})
                return "ran"

            key3 = new_key("saga-careless")
            with pytest.raises(TypeError, match="recover="):
                await careless(idempotency_key=key3)
            assert record_state(admin, "saga", key3) is None
    arun(main())


def test_1_4_begin_arguments(needs_1_4: None) -> None:
    """1.4: takeover and remember are passed to idem_begin."""
    async def main() -> None:
        async with await open_pool(1) as pool, \
                idem.AsyncCoordinator(pool, takeover="session", remember=timedelta(days=7)) as coordinator:
            claim = await coordinator.begin("op.args", new_key("args"), idem.fingerprint())
            assert claim.status == "new"
            assert await claim.finish(1) == 1
    arun(main())
