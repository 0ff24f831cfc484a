"""The coordinator's idem_begin arguments: durations as seconds or
timedelta, policies in any case, and NULL for what the caller did not give,
so that the server's settings (docs/settings.md, "Settings") apply."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from conftest import new_key
from psycopg import sql
from psycopg_pool import ConnectionPool

import idempotency_pg as idem

OP = "op.settings"


def spans(admin: psycopg.Connection[Any], key: str) -> Any:
    """(lease_until - created_at, expires_at - completed_at) of the key's record."""
    row = admin.execute("SELECT lease_until - created_at, expires_at - completed_at"
                        "  FROM idem_inspect(%s::text, %s::text)", (OP, key)).fetchone()
    assert row is not None
    return row


def claim_and_finish(coordinator: idem.Coordinator, admin: psycopg.Connection[Any]) -> Any:
    """The claim's lease and the completed record's ttl."""
    key = new_key("settings")
    claim = coordinator.begin(OP, key, idem.fingerprint())
    lease = spans(admin, key)[0]
    claim.finish(1)
    return lease, spans(admin, key)[1]


def near(span: timedelta, expected: timedelta) -> bool:
    return abs(span - expected) < timedelta(seconds=1)


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as p:
        yield p


def test_durations_as_seconds_and_policies_in_any_case(admin: psycopg.Connection[Any],
                                                       pool: ConnectionPool) -> None:
    with idem.Coordinator(pool, in_flight="WAIT", lease=30, ttl=5400.5) as coordinator:
        lease, ttl = claim_and_finish(coordinator, admin)
        assert near(lease, timedelta(seconds=30)) and ttl == timedelta(seconds=5400.5)
    with idem.Coordinator(pool, in_flight="Raise", lease=timedelta(seconds=20), ttl="2 hours") as coordinator:
        assert coordinator.settings.in_flight == "raise"
        lease, ttl = claim_and_finish(coordinator, admin)
        assert near(lease, timedelta(seconds=20)) and ttl == timedelta(hours=2)
    with pytest.raises(TypeError, match="lease must be a timedelta"):
        idem.Coordinator(pool, lease=[30])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ttl must be"):
        idem.Coordinator(pool, ttl=True)
    with pytest.raises(ValueError, match='in_flight must be "wait" or "raise"'):
        idem.Coordinator(pool, in_flight="later")
    with pytest.raises(ValueError, match="takeover must be"):
        idem.Coordinator(pool, takeover="never")
    # the values themselves are the server's to check
    with idem.Coordinator(pool, lease=-1) as coordinator, pytest.raises(idem.InvalidRequestError):
        coordinator.begin(OP, new_key("settings"), idem.fingerprint())


def test_role_settings_apply_unless_given(admin: psycopg.Connection[Any]) -> None:
    """A DBA's ALTER ROLE ... SET idempotency.lease / idempotency.ttl holds
    for a coordinator that was given neither; arguments given win."""
    db = admin.execute("SELECT current_database()").fetchone()
    assert db is not None
    role = sql.SQL("ALTER ROLE CURRENT_USER IN DATABASE {} ").format(sql.Identifier(db[0]))
    admin.execute(role + sql.SQL("SET idempotency.lease = '45 s'"))
    admin.execute(role + sql.SQL("SET idempotency.ttl = '3 h'"))
    try:
        # new connections, which get the role's settings
        with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool:
            with idem.Coordinator(pool) as coordinator:
                lease, ttl = claim_and_finish(coordinator, admin)
                assert near(lease, timedelta(seconds=45)) and ttl == timedelta(hours=3)
            with idem.Coordinator(pool, ttl=timedelta(hours=5)) as coordinator:
                lease, ttl = claim_and_finish(coordinator, admin)
                assert near(lease, timedelta(seconds=45)) and ttl == timedelta(hours=5)
    finally:
        admin.execute(role + sql.SQL("RESET idempotency.lease"))
        admin.execute(role + sql.SQL("RESET idempotency.ttl"))


def test_version_is_the_distribution_s() -> None:
    """``__version__`` is the version pyproject.toml gives the distribution."""
    import pathlib
    import tomllib
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    with open(pyproject, "rb") as f:
        assert idem.__version__ == tomllib.load(f)["project"]["version"]
