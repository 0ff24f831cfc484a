"""A serialization failure (40001) on a held claim's own statement: the
statement's transaction rolled back and nothing was done (a Citus shard
move raced it: docs/scaling-out.md; or a server whose
default_transaction_isolation is repeatable read).  In the external-call
shape the finish is sent again, so that the function's result is stored
and it never runs a second time; in the in-transaction shape the failure
aborted the caller's transaction and is raised."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import arun, new_key, record_state
from psycopg import sql
from psycopg_pool import ConnectionPool
from test_async import open_pool

import idempotency_pg as idem

OP = "op.serialization"


class FailFirstFinish:
    """A trigger on the record tables that fails the first write of a
    completed record of ``key`` with 40001 and lets later ones through;
    ``attempts`` counts the finishes (a sequence: not rolled back with
    them)."""

    def __init__(self, admin: psycopg.Connection[Any], key: str) -> None:
        self.admin = admin
        admin.execute("CREATE SEQUENCE finish_attempts")
        admin.execute(sql.SQL("""CREATE FUNCTION fail_first_finish() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.key = {} AND NEW.completed_at IS NOT NULL
                   AND nextval('finish_attempts') = 1 THEN
                    RAISE EXCEPTION 'the record of % moved', NEW.key USING ERRCODE = 'serialization_failure';
                END IF;
                RETURN NEW;
            END $$""").format(sql.Literal(key)))
        # a completed record is written to idem_record, or to idem_result in
        # the modes that keep completed records apart
        for table in ("idem_record", "idem_result"):
            row = admin.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
            if row and row[0]:
                admin.execute(sql.SQL("CREATE TRIGGER fail_first_finish BEFORE INSERT OR UPDATE ON {}"
                                      " FOR EACH ROW EXECUTE FUNCTION fail_first_finish()")
                              .format(sql.Identifier(table)))

    @property
    def attempts(self) -> int:
        row = self.admin.execute("SELECT CASE WHEN is_called THEN last_value ELSE 0 END"
                                 " FROM finish_attempts").fetchone()
        assert row is not None
        return int(row[0])

    def drop(self) -> None:
        self.admin.execute("DROP FUNCTION fail_first_finish() CASCADE")
        self.admin.execute("DROP SEQUENCE finish_attempts")


@pytest.fixture
def fail_first(admin: psycopg.Connection[Any]) -> Iterator[tuple[str, FailFirstFinish]]:
    key = new_key("serialization")
    trigger = FailFirstFinish(admin, key)
    try:
        yield key, trigger
    finally:
        trigger.drop()


def test_finish_retried_sync(admin: psycopg.Connection[Any], fail_first: tuple[str, FailFirstFinish]) -> None:
    key, trigger = fail_first
    ran: list[str] = []
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool, takeover="session") as coordinator:
        @coordinator.idempotent(operation=OP)
        def charge(*, idempotency_key: str) -> dict[str, Any]:
            ran.append(idempotency_key)
            return {"charged": idempotency_key}

        assert charge(idempotency_key=key) == {"charged": key}
        assert trigger.attempts == 2, "the finish failed once with 40001 and was sent again"
        assert record_state(admin, OP, key) == "completed"
        assert charge.outcome(idempotency_key=key) == idem.Outcome({"charged": key}, replayed=True)
        assert ran == [key], "the function ran once"


def test_finish_retried_async(admin: psycopg.Connection[Any], fail_first: tuple[str, FailFirstFinish]) -> None:
    key, trigger = fail_first

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool, takeover="session") as coordinator:
            claim = await coordinator.begin(OP, key, None)
            assert claim.status == "new"
            assert await claim.finish({"charged": key}) == {"charged": key}
            assert trigger.attempts == 2, "the finish failed once with 40001 and was sent again"
            assert record_state(admin, OP, key) == "completed"
            again = await coordinator.begin(OP, key, None)
            assert (again.status, again.response) == ("replay", {"charged": key})

    arun(main())


def test_in_transaction_finish_raises(admin: psycopg.Connection[Any],
                                      fail_first: tuple[str, FailFirstFinish]) -> None:
    key, trigger = fail_first
    coordinator = idem.Coordinator(ConnectionPool("", min_size=1, max_size=1, open=False))
    with psycopg.connect("") as conn:
        with pytest.raises(psycopg.errors.SerializationFailure):
            with coordinator.claim(conn, OP, key, None) as claim:
                assert claim.status == "new"
                claim.finish({"charged": key})
        assert trigger.attempts == 1, "not sent again in the caller's aborted transaction"
        conn.rollback()
    assert record_state(admin, OP, key) is None
