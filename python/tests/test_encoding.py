"""Results through the one encoder (idempotency_pg.encoding): stored as plain
JSON, restored on replay to the function's return annotation -- pydantic
models, dataclasses, datetime, UUID, Decimal -- equal to the first call's."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import arun, new_key
from psycopg_pool import ConnectionPool
from pydantic import BaseModel
from test_async import open_pool

import idempotency_pg as idem
from idempotency_pg.encoding import decode, encode

OP = "op.encoding"
AT = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2)))
ID = uuid.UUID("0b1e5f5e-8d6f-4f55-9a57-7c5a0e3b2a10")


class State(enum.Enum):
    PAID = "paid"


class Receipt(BaseModel):
    id: uuid.UUID
    at: datetime
    amount: int


@dataclass
class Line:
    price: Decimal
    on: date


@dataclass
class Charge:
    id: uuid.UUID
    at: datetime
    total: Decimal
    state: State
    lines: list[Line] = field(default_factory=list)
    receipt: Receipt | None = None
    pair: tuple[int, str] = (0, "")


def stored(admin: psycopg.Connection[Any], key: str) -> Any:
    row = admin.execute("SELECT response FROM idem_inspect(%s::text, %s::text)", (OP, key)).fetchone()
    assert row is not None
    return row[0]


CHARGE = Charge(ID, AT, Decimal("12.50"), State.PAID, [Line(Decimal("0.10"), date(2026, 1, 2))],
                Receipt(id=ID, at=AT, amount=99_999_999_999_999), (7, "x"))


def test_round_trip_async(admin: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as coordinator:
            @coordinator.idempotent(OP)
            async def charge(*, idempotency_key: str) -> Charge:
                return CHARGE

            @coordinator.idempotent(OP)
            async def receipt(*, idempotency_key: str) -> Receipt:
                return CHARGE.receipt  # type: ignore[return-value]

            @coordinator.idempotent(OP)
            async def total(*, idempotency_key: str) -> Decimal:
                return Decimal("1E+2")

            @coordinator.idempotent(OP)
            async def when(*, idempotency_key: str) -> datetime | None:
                return AT

            @coordinator.idempotent(OP)
            async def ids(*, idempotency_key: str) -> dict[str, uuid.UUID]:
                return {"a": ID}

            for func, expected in ((charge, CHARGE), (receipt, CHARGE.receipt), (total, Decimal("1E+2")),
                                   (when, AT), (ids, {"a": ID})):
                key = new_key("enc")
                first = await func(idempotency_key=key)
                replay = await func.outcome(idempotency_key=key)
                assert replay.replayed and first == replay.value == expected
                assert type(replay.value) is type(expected)
            key = new_key("enc-stored")
            await charge(idempotency_key=key)
            assert stored(admin, key) == {
                "id": str(ID), "at": "2026-01-02T03:04:05.000006+02:00", "total": "12.50", "state": "paid",
                "lines": [{"price": "0.10", "on": "2026-01-02"}],
                "receipt": {"id": str(ID), "at": AT.isoformat(), "amount": 99_999_999_999_999},
                "pair": [7, "x"]}
            assert type(stored(admin, key)["receipt"]["amount"]) is int, "an int stays exact"
    arun(main())


def test_round_trip_sync_and_result_type(admin: psycopg.Connection[Any]) -> None:
    """The sync decorator; result_type= wins over the annotation."""
    with ConnectionPool("", min_size=1, max_size=2, timeout=10, open=True) as pool, \
            idem.Coordinator(pool) as coordinator:
        @coordinator.idempotent(OP, result_type=Receipt)
        def receipt(*, idempotency_key: str) -> Any:
            return {"id": str(ID), "at": AT.isoformat(), "amount": 5}

        key = new_key("enc-sync")
        first = receipt(idempotency_key=key)
        assert first == receipt(idempotency_key=key) == Receipt(id=ID, at=AT, amount=5)


def test_encoder_refuses_what_json_cannot_keep() -> None:
    for value in ({1, 2}, b"x", float("nan"), {(1, 2): 3}, object()):
        with pytest.raises((TypeError, ValueError)):
            encode(value)
    # JSON's own types come back as stored, whatever the annotation says of them
    assert decode({"a": 1}, dict[str, Any]) == {"a": 1} and decode([1], Any) == [1]
    with pytest.raises(TypeError):
        decode(5, datetime)
