"""What the package reads of the server's errors does not depend on the
language of its messages: lc_messages is a server setting a DBA chooses,
and every message the server can translate reads differently then.

The connections here speak German (lc_messages = 'de_DE.UTF-8', which needs
the OS locale, Debian's package locales-all, and the server's German
message catalogue, postgres-NN.mo).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import idempotency_pg as idem

GERMAN = "-c lc_messages=de_DE.UTF-8"


@pytest.fixture
def german_pool(admin: psycopg.Connection[Any]) -> Iterator[ConnectionPool]:
    """A pool whose sessions get the server's messages in German."""
    with psycopg.connect("", options=GERMAN, autocommit=True) as conn:
        try:
            conn.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero as err:
            message = err.diag.message_primary or ""
        if message == "division by zero":
            pytest.skip("the server has no German message catalogue (postgres-NN.mo)")
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True,
                        kwargs={"options": GERMAN}) as pool:
        yield pool


def test_key_reuse_fingerprints_in_german(german_pool: ConnectionPool) -> None:
    """IK422's two fingerprints are read from its DETAIL in any language."""
    with idem.Coordinator(german_pool) as coordinator:
        key = "german-" + str(uuid.uuid4())
        coordinator.begin("op.german", key, idem.fingerprint(1)).finish({"done": True})
        with pytest.raises(idem.KeyReuseError) as info:
            coordinator.begin("op.german", key, idem.fingerprint(2))
        assert info.value.stored_fingerprint == idem.fingerprint(1).hex()
        assert info.value.request_fingerprint == idem.fingerprint(2).hex()


def test_wait_timeout_in_german(german_pool: ConnectionPool) -> None:
    """A wait that reaches wait_timeout is a WaitTimeoutError in any language
    (the server's "canceling statement due to statement timeout" is
    translated)."""
    with idem.Coordinator(german_pool, wait_timeout=0.2) as coordinator:
        key = "german-wait-" + str(uuid.uuid4())
        held = coordinator.begin("op.german", key, idem.fingerprint())
        with pytest.raises(idem.WaitTimeoutError) as info:
            coordinator.begin("op.german", key, idem.fingerprint())
        assert info.value.key == key and info.value.sqlstate == "57014"
        assert isinstance(info.value.__cause__, psycopg.errors.QueryCanceled)
        held.finish({"done": True})
        assert coordinator.begin("op.german", key, idem.fingerprint()).status == "replay"
