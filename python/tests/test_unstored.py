"""A result that cannot be stored after the function ran (python/README.md,
"When the result cannot be stored"): the call fails loudly, the error is
logged, and the claim keeps a checkpoint, so that the retry gets 'recover'
instead of running the function a second time."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from conftest import arun, new_key
from psycopg_pool import ConnectionPool
from test_async import open_pool

import idempotency_pg as idem

OP = "op.unstored"
# larger than idempotency.max_response_size's default, 64kB
# (a set has no JSON form: idempotency_pg.encoding refuses it, nothing is sent)
UNSTORABLE = {"not-json": {"tags": {"a", "b"}},
              "oversize": {"blob": "x" * 70_000}}
SQLSTATE = {"not-json": None, "oversize": "54000"}


def kill_other_backends(admin: psycopg.Connection[Any]) -> None:
    """Terminate every other connection to the test database, and wait for
    each to exit: the connection that claimed and the pools' idle ones."""
    rows = admin.execute("SELECT pid, pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                         " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                         "   AND backend_type = 'client backend'").fetchall()
    assert rows
    # pg_terminate_backend is false for a backend that exited on its own
    # between the scan and the call: what counts is that none is left
    pids = [r[0] for r in rows]
    left = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
                         (pids,)).fetchone()
    assert left is not None and left[0] == 0


def record_state(admin: psycopg.Connection[Any], key: str) -> str | None:
    row = admin.execute("SELECT state FROM idem_inspect(%s, %s)", (OP, key)).fetchone()
    return None if row is None else row[0]


def logged_errors(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "idempotency_pg" and r.levelno == logging.ERROR and key in r.getMessage()]


@pytest.mark.parametrize("kind", ["not-json", "oversize"])
def test_unstorable_result_async(admin: psycopg.Connection[Any], needs_1_4: None,
                                 caplog: pytest.LogCaptureFixture, kind: str) -> None:
    async def main() -> None:
        # a 1 s lease: without a checkpoint the retry would run the function again after it
        async with await open_pool(2) as pool, \
                idem.AsyncCoordinator(pool, takeover="session", lease=1) as coordinator:
            ran: list[str] = []

            @coordinator.idempotent(operation=OP)
            async def act(*, idempotency_key: str) -> Any:
                ran.append(idempotency_key)
                return UNSTORABLE[kind]

            key = new_key(kind)
            with pytest.raises(idem.ResponseNotStoredError) as info:
                await act(idempotency_key=key)
            assert info.value.checkpointed and info.value.sqlstate == SQLSTATE[kind]
            assert info.value.result == UNSTORABLE[kind]
            if kind == "oversize":
                assert info.value.detail is not None
                assert isinstance(info.value.__cause__, idem.ResponseTooLargeError)
            assert logged_errors(caplog, key), "the failure is logged at error level"
            # the retry takes over the package's own not-stored checkpoint and,
            # without recover=, completes the key with it: ResponseNotStoredError,
            # as every later retry gets, never RecoveryNeededError nor a second run
            for attempt in ("completes", "replays"):
                with pytest.raises(idem.ResponseNotStoredError) as retry:
                    await act(idempotency_key=key)
                assert retry.value.completed and not retry.value.checkpointed, attempt
                assert retry.value.sqlstate == SQLSTATE[kind] and retry.value.result is None
                assert record_state(admin, key) == "completed", attempt
            assert ran == [key]
    arun(main())


def test_unstored_checkpoint_completes_the_key_sync(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """The same with Coordinator: the retry that takes over the package's own
    not-stored checkpoint, without recover=, completes the key with it."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool, takeover="session", lease=1) as coordinator:
        ran: list[str] = []

        @coordinator.idempotent(operation=OP)
        def act(*, idempotency_key: str) -> Any:
            ran.append(idempotency_key)
            return UNSTORABLE["oversize"]

        key = new_key("sync-terminal")
        with pytest.raises(idem.ResponseNotStoredError) as info:
            act(idempotency_key=key)
        assert info.value.checkpointed and not info.value.completed
        for attempt in ("completes", "replays"):
            with pytest.raises(idem.ResponseNotStoredError) as retry:
                act.outcome(idempotency_key=key)
            assert retry.value.completed and retry.value.sqlstate == "54000", attempt
            assert record_state(admin, key) == "completed", attempt
        assert ran == [key]


def test_unstorable_result_sync(admin: psycopg.Connection[Any], needs_1_4: None,
                                caplog: pytest.LogCaptureFixture) -> None:
    """The same with Coordinator, and a function that had checkpointed: its
    own checkpoint is what the retry's recover= gets."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool, takeover="session", lease=1) as coordinator:
        ran: list[str] = []

        @coordinator.idempotent(operation=OP, recover=lambda state, **_: {"recovered": state})
        def act(*, idempotency_key: str) -> Any:
            ran.append(idempotency_key)
            idem.current_claim().checkpoint({"step": "provider called"})
            return UNSTORABLE["not-json"]

        key = new_key("sync")
        with pytest.raises(idem.ResponseNotStoredError) as info:
            act(idempotency_key=key)
        assert info.value.checkpointed and isinstance(info.value.__cause__, TypeError)
        assert logged_errors(caplog, key)
        assert act.outcome(idempotency_key=key) == idem.Outcome({"recovered": {"step": "provider called"}}, False)
        assert ran == [key]


def test_connection_lost_before_the_finish_async(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """Every connection is terminated between the function and the finish:
    the finish goes to a new connection, and the retry replays."""
    async def main() -> None:
        async with await open_pool(2) as pool, \
                idem.AsyncCoordinator(pool, takeover="session", lease=1) as coordinator:
            ran: list[str] = []

            @coordinator.idempotent(operation=OP)
            async def act(*, idempotency_key: str) -> Any:
                ran.append(idempotency_key)
                kill_other_backends(admin)
                return {"charged": idempotency_key}

            key = new_key("killed")
            first = await act.outcome(idempotency_key=key)
            assert first == idem.Outcome({"charged": key}, replayed=False)
            assert await act.outcome(idempotency_key=key) == idem.Outcome(first.value, replayed=True)
            assert ran == [key]
    arun(main())


def test_connection_lost_before_the_finish_sync(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool, takeover="session", lease=1) as coordinator:
        ran: list[str] = []

        @coordinator.idempotent(operation=OP)
        def act(*, idempotency_key: str) -> Any:
            ran.append(idempotency_key)
            kill_other_backends(admin)
            return {"charged": idempotency_key}

        key = new_key("killed-sync")
        first = act.outcome(idempotency_key=key)
        assert first == idem.Outcome({"charged": key}, replayed=False)
        assert act.outcome(idempotency_key=key) == idem.Outcome(first.value, replayed=True)
        assert ran == [key]
