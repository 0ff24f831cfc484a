"""The client-side fingerprint against the server's idem_fingerprint, and the
SQLSTATE -> exception mapping."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import sql

import idempotency_pg as idem
from idempotency_pg._core import db_errors

# (values, the SQL types the server gets them as)
CASES = [
    (("a", "bc"), ("text", "text")),
    (("ab", "c"), ("text", "text")),
    ((None,), ("text",)),
    (("",), ("text",)),
    ((None, ""), ("text", "text")),
    (("", None), ("text", "text")),
    (("cus_dave", 1000, "EUR"), ("text", "bigint", "text")),
    ((0, -42, 9223372036854775807), ("bigint", "bigint", "bigint")),
    ((True, False), ("boolean", "boolean")),
    ((Decimal("1.50"), Decimal("1E+2"), Decimal("-0.00"), Decimal("NaN")),
     ("numeric", "numeric", "numeric", "numeric")),
    ((uuid.UUID("8e03978e-40d5-43e8-bc93-6894a57f9324"),), ("uuid",)),
    (("żółw ☃ \t\n\\ \"'",), ("text",)),
    (("x" * 70000,), ("text",)),
]


@pytest.mark.parametrize("values,types", CASES)
def test_fingerprint_equals_the_servers(admin: psycopg.Connection[Any], portable: bool, values: Any,
                                        types: Any) -> None:
    """fingerprint(values) is idem_fingerprint(values) byte for byte.  The
    portable edition takes one or two arguments of any types, or text ones
    (docs/managed-postgresql.md, "idem_fingerprint"): more that are not all
    text do not resolve, and a caller passes their text forms instead."""
    args = ", ".join(f"%s::{t}" for t in types)
    if portable and len(types) > 2 and set(types) != {"text"}:
        with pytest.raises(psycopg.errors.UndefinedFunction):
            admin.execute(f"SELECT idem_fingerprint({args})", values)
        args = ", ".join(f"%s::{t}::text" for t in types)
    row = admin.execute(f"SELECT idem_fingerprint({args})", values).fetchone()
    assert row is not None
    assert idem.fingerprint(*values) == bytes(row[0])


def test_fingerprint_boundaries() -> None:
    """Argument boundaries and NULL are part of the encoding."""
    assert idem.fingerprint("a", "bc") != idem.fingerprint("ab", "c")
    assert idem.fingerprint(None) != idem.fingerprint("")
    assert idem.fingerprint("a", None) != idem.fingerprint(None, "a")
    assert idem.fingerprint() != idem.fingerprint(None)
    assert len(idem.fingerprint("x")) == 32


@pytest.mark.parametrize("value", [1.5, b"\x00", object()])
def test_fingerprint_refuses_setting_dependent_types(value: Any) -> None:
    with pytest.raises(TypeError, match="pass it as str"):
        idem.fingerprint(value)


def raise_sqlstate(admin: psycopg.Connection[Any], sqlstate: str, detail: str = "d") -> None:
    """Raise an error of that SQLSTATE and DETAIL in the server, through db_errors."""
    with db_errors():
        admin.execute(sql.SQL("DO $$BEGIN RAISE EXCEPTION 'synthetic' USING ERRCODE = {}, DETAIL = {}; END$$")
                      .format(sql.Literal(sqlstate), sql.Literal(detail)))


@pytest.mark.parametrize("sqlstate,cls", [
    ("IK409", idem.InProgressError), ("IK410", idem.ResponseExpiredError),
    ("IK412", idem.LostClaimError), ("IK422", idem.KeyReuseError),
    ("22023", idem.InvalidRequestError), ("22004", idem.InvalidRequestError),
    ("54000", idem.ResponseTooLargeError),
])
def test_sqlstate_classes(admin: psycopg.Connection[Any], sqlstate: str, cls: type) -> None:
    """One class per SQLSTATE, carrying the SQLSTATE and the DETAIL."""
    info: Any
    with pytest.raises(cls) as info:
        raise_sqlstate(admin, sqlstate, "The detail.")
    assert isinstance(info.value, idem.IdempotencyError)
    assert info.value.sqlstate == sqlstate
    assert info.value.detail == "The detail."
    assert isinstance(info.value.__cause__, psycopg.Error)


def test_other_sqlstates_pass_through(admin: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.SerializationFailure):
        raise_sqlstate(admin, "40001")


def test_key_reuse_fingerprints_from_the_detail(admin: psycopg.Connection[Any]) -> None:
    """The DETAIL forms the server writes: hex, NULL, and a cut fingerprint."""
    with pytest.raises(idem.KeyReuseError) as info:
        raise_sqlstate(admin, "IK422", "Stored fingerprint: NULL. Request fingerprint: \\xab01.")
    assert (info.value.stored_fingerprint, info.value.request_fingerprint) == (None, "ab01")
    with pytest.raises(idem.KeyReuseError) as info:
        raise_sqlstate(admin, "IK422",
                       "Stored fingerprint: \\xff... (100 bytes). Request fingerprint: \\x00.")
    assert (info.value.stored_fingerprint, info.value.request_fingerprint) == ("ff...", "00")


def test_key_reuse_long_fingerprints_from_the_server(admin: psycopg.Connection[Any]) -> None:
    """A fingerprint over 64 bytes, which the server's DETAIL cuts ("\\x<64
    bytes>... (100 bytes)"): the hex it has, ending in "..."; NULL, empty and
    64 bytes are whole."""
    from psycopg_pool import ConnectionPool
    with ConnectionPool("", min_size=1, max_size=2, open=True) as pool, \
            idem.Coordinator(pool, in_flight="raise") as coordinator:
        key = "reuse-long-" + str(uuid.uuid4())
        coordinator.begin("op.errors", key, b"\xab" * 100).finish({"ok": True})
        for fp, hex_ in ((b"\xcd" * 65, "cd" * 64 + "..."), (None, None), (b"", ""), (b"\xef" * 64, "ef" * 64)):
            with pytest.raises(idem.KeyReuseError) as reuse:
                coordinator.begin("op.errors", key, fp)
            assert "(100 bytes)" in (reuse.value.detail or "")
            assert (reuse.value.stored_fingerprint, reuse.value.request_fingerprint) == ("ab" * 64 + "...", hex_)


def test_errors_from_the_server(admin: psycopg.Connection[Any]) -> None:
    """The real errors of idem_begin / idem_finish, through a coordinator."""
    from psycopg_pool import ConnectionPool
    with ConnectionPool("", min_size=1, max_size=2, open=True) as pool, \
            idem.Coordinator(pool, in_flight="raise") as coordinator:
        key = "errors-" + str(uuid.uuid4())
        claim = coordinator.begin("op.errors", key, idem.fingerprint(1))
        assert claim.status == "new"
        with pytest.raises(idem.InProgressError) as busy:
            coordinator.begin("op.errors", key, idem.fingerprint(1))
        assert busy.value.sqlstate == "IK409"
        with pytest.raises(idem.KeyReuseError) as reuse:
            coordinator.begin("op.errors", key, idem.fingerprint(2))
        assert reuse.value.stored_fingerprint == idem.fingerprint(1).hex()
        assert reuse.value.request_fingerprint == idem.fingerprint(2).hex()
        with pytest.raises(idem.InvalidRequestError) as bad:
            coordinator.begin("op.errors", "", idem.fingerprint(1))
        assert bad.value.sqlstate == "22023"
        assert claim.finish({"ok": True}) == {"ok": True}
        assert claim.token is not None
        claim.token = claim.token + 1  # a token that never held the key
        with pytest.raises(idem.LostClaimError):
            claim.finish({"ok": False})
        assert claim.abort() is False
