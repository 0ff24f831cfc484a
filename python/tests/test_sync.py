"""Coordinator (threads, ConnectionPool) against the real server: the same
behaviour as AsyncCoordinator."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from conftest import new_key, record_state, wait_for, waiting_claims
from psycopg_pool import ConnectionPool

import idempotency_pg as idem
from test_async import Charge

OP = "payment.charge"


class Provider:
    """Counts its calls; each call waits for ``gate`` (set unless a test clears it)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False

    def charge(self, order_id: str, amount: int, key: str) -> dict[str, Any]:
        self.calls.append((order_id, amount, key))
        assert self.gate.wait(30)
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("provider timed out")
        return {"id": f"ch_{len(self.calls)}", "amount": amount}


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    with ConnectionPool("", min_size=3, max_size=3, timeout=10, open=True) as p:
        yield p


def service(coordinator: idem.Coordinator, provider: Provider) -> Any:
    @coordinator.idempotent(operation=OP, fingerprint_params=("order_id", "amount"))
    def charge(order_id: str, amount: int, *, idempotency_key: str | None) -> Any:
        return provider.charge(order_id, amount, idempotency_key or "")
    return charge


def test_runs_once_replays_and_aborts(admin: psycopg.Connection[Any], pool: ConnectionPool) -> None:
    with idem.Coordinator(pool) as coordinator:
        provider = Provider()
        charge = service(coordinator, provider)
        key = new_key("sync-once")
        provider.fail_next = True
        with pytest.raises(ConnectionError):
            charge("o1", 10, idempotency_key=key)
        assert record_state(admin, OP, key) is None, "errors are not cached"
        first = charge("o1", 10, idempotency_key=key)
        assert charge.outcome("o1", 10, idempotency_key=key) == idem.Outcome(first, replayed=True)
        with pytest.raises(idem.KeyReuseError):
            charge("o1", 11, idempotency_key=key)
        charge("o1", 10, idempotency_key=None)
        assert len(provider.calls) == 3


@pytest.mark.parametrize("in_flight", ["wait", "raise"])
def test_duplicates_on_a_pool_of_n(admin: psycopg.Connection[Any], pool: ConnectionPool, in_flight: str) -> None:
    """N = 3 duplicates of a running call on a pool of 3: with wait, they all
    wait and then replay (no deadlock: the first call finishes on the
    connection that claimed, which it keeps); with raise, each gets IK409."""
    n = pool.max_size
    with idem.Coordinator(pool, in_flight=in_flight, claim_pool_size=n + 1) as coordinator, \
            ThreadPoolExecutor(n + 1) as threads:
        provider = Provider()
        provider.gate.clear()
        charge = service(coordinator, provider)
        key = new_key("sync-" + in_flight)
        first = threads.submit(charge, "o2", 20, idempotency_key=key)
        wait_for("the first call is at the provider", lambda: len(provider.calls) == 1)
        if in_flight == "raise":
            for _ in range(n):
                with pytest.raises(idem.InProgressError):
                    charge("o2", 20, idempotency_key=key)
            provider.gate.set()
            assert first.result(20) == charge("o2", 20, idempotency_key=key)
        else:
            dups = [threads.submit(charge.outcome, "o2", 20, idempotency_key=key) for _ in range(n)]
            wait_for(f"{n} duplicates wait", lambda: waiting_claims(admin) == n)
            provider.gate.set()
            result = first.result(20)
            assert [d.result(20) for d in dups] == [idem.Outcome(result, replayed=True)] * n
        assert len(provider.calls) == 1


def test_in_transaction_shape(admin: psycopg.Connection[Any], pool: ConnectionPool) -> None:
    coordinator = idem.Coordinator(pool)
    key = new_key("sync-tx")
    with pool.connection() as conn:
        with coordinator.claim(conn, "order.create", key, idem.fingerprint(5)) as c:
            assert c.status == "new"
            stored = c.finish({"order": key})
        conn.rollback()
        assert record_state(admin, "order.create", key) is None
        with coordinator.claim(conn, "order.create", key, idem.fingerprint(5)) as c:
            stored = c.finish({"order": key})
        conn.commit()
        with coordinator.claim(conn, "order.create", key, idem.fingerprint(5)) as c:
            assert (c.status, c.response, c.token) == ("replay", stored, None)
        conn.commit()


def test_checkpoint_and_recover(admin: psycopg.Connection[Any], pool: ConnectionPool, needs_1_4: None) -> None:
    with idem.Coordinator(pool, lease=timedelta(milliseconds=200)) as coordinator:
        @coordinator.idempotent(operation="saga", recover=lambda state, **_: {"resumed": state})
        def saga(*, idempotency_key: str) -> Any:
            idem.current_claim().checkpoint({"step": 1})
            return "done"

        assert saga(idempotency_key=new_key("sync-saga-ok")) == "done"
        key = new_key("sync-saga")
        dead = coordinator.begin("saga", key, idem.fingerprint())
        dead.checkpoint({"step": 2})
        dead.abandon()  # its connection closes
        wait_for("the lease lapses", lambda: record_state(admin, "saga", key) == "lapsed")
        assert saga.outcome(idempotency_key=key) == idem.Outcome({"resumed": {"step": 2}}, False)
        with pytest.raises(idem.LostClaimError):
            dead.finish("late")

        # without recover=, a checkpoint is refused: nothing written, the
        # claim aborted
        @coordinator.idempotent(operation="saga")
        def careless(*, idempotency_key: str) -> Any:
            idem.current_claim().checkpoint({"step": 1})
            return "ran"

        key2 = new_key("sync-saga-careless")
        with pytest.raises(TypeError, match="recover="):
            careless(idempotency_key=key2)
        assert record_state(admin, "saga", key2) is None


def test_result_type_pydantic(pool: ConnectionPool) -> None:
    """A pydantic result is stored as JSON and restored as the model on replay."""
    with idem.Coordinator(pool) as coordinator:
        provider = Provider()

        @coordinator.idempotent(operation=OP, fingerprint_params=("amount",), result_type=Charge)
        def charge(amount: int, *, idempotency_key: str) -> Charge:
            return Charge(**provider.charge("o", amount, idempotency_key))

        key = new_key("sync-model")
        first = charge(7, idempotency_key=key)
        replay = charge(7, idempotency_key=key)
        assert isinstance(replay, Charge) and first == replay == Charge(id="ch_1", amount=7)
        assert len(provider.calls) == 1


def test_1_4_begin_arguments(admin: psycopg.Connection[Any], pool: ConnectionPool, needs_1_4: None) -> None:
    """1.4: takeover and remember are passed to idem_begin (the server
    accepts the remember); the 'session' claim lapses as soon as its
    connection closes, long before its lease."""
    with idem.Coordinator(pool, takeover="session", remember=timedelta(days=7),
                          lease=timedelta(hours=1)) as coordinator:
        key = new_key("sync-args")
        claim = coordinator.begin("op.args", key, idem.fingerprint())
        assert claim.status == "new"
        claim.abandon()
        wait_for("the session claim lapses", lambda: record_state(admin, "op.args", key) == "lapsed")
        again = coordinator.begin("op.args", key, idem.fingerprint())
        assert again.status == "new"
        assert again.finish(1) == 1
