"""A simulated payment provider: the external call the Idempotency-Key
protects.  It records the charge in its ledger, ``provider_charges``
(``payments-api/schema.sql``), through its own pool, outside any transaction
of the API.  The charge is made when the call arrives; the answer comes
``delay_ms`` later (300 ms, as in README's scenarios).

The API passes the Idempotency-Key on, and the provider deduplicates by it,
as real payment providers do (and as ``payments-api/provider.js`` does): a
second call with the same key returns the first charge and charges nothing.
Each call is counted (``calls``), so a test sees an API that called twice
even though the customer was charged once; a call that reuses a key with
other parameters is refused.  ``find`` answers whether a charge was made with
a key (the API asks it after taking over a dead attempt's claim, app.py).  For
``flaky_customers`` the first call per key times out without charging: errors must not be cached."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import timezone
from typing import Any

from psycopg_pool import AsyncConnectionPool

FIND_SQL = "SELECT id, created_at, customer, amount, currency FROM provider_charges WHERE provider_key = %s::text"

CHARGE_SQL = (
    "INSERT INTO provider_charges AS p (provider_key, customer, amount, currency)"
    " VALUES (%s::text, %s::text, %s::bigint, %s::text)"
    " ON CONFLICT (provider_key) DO UPDATE SET calls = p.calls + 1"
    " RETURNING id, created_at, customer, amount, currency")


class ProviderError(Exception):
    """The provider did not confirm the charge (it may or may not have been made)."""


class Provider:
    def __init__(self, pool: AsyncConnectionPool, *, delay_ms: int = 300,
                 flaky_customers: Iterable[str] = ()) -> None:
        self.pool = pool
        self.delay_ms = delay_ms
        self.flaky = set(flaky_customers)
        self.failed_once: set[str] = set()

    async def find(self, idempotency_key: str, customer: str, amount: int,
                   currency: str) -> dict[str, Any] | None:
        """The charge made with this key, or ``None`` (a real provider's
        "list charges by idempotency key"); it charges nothing."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(FIND_SQL, (idempotency_key,))
            row = await cur.fetchone()
        return None if row is None else self._answer(row, idempotency_key, customer, amount, currency)

    async def charge(self, idempotency_key: str, customer: str, amount: int, currency: str) -> dict[str, Any]:
        """Charge, or return the charge already made with this key;
        returns ``{"id": "ch_N", "created": ISO time}``.  Raises ProviderError."""
        if customer in self.flaky and idempotency_key not in self.failed_once:
            self.failed_once.add(idempotency_key)
            await asyncio.sleep(self.delay_ms / 1000)
            raise ProviderError(f"provider timed out charging {customer}")
        async with self.pool.connection() as conn:
            cur = await conn.execute(CHARGE_SQL, (idempotency_key, customer, amount, currency))
            row = await cur.fetchone()
        assert row is not None
        await asyncio.sleep(self.delay_ms / 1000)
        return self._answer(row, idempotency_key, customer, amount, currency)

    @staticmethod
    def _answer(row: tuple[Any, ...], idempotency_key: str, customer: str, amount: int,
                currency: str) -> dict[str, Any]:
        """The provider's answer for its ledger row ``row``."""
        if (row[2], row[3], row[4]) != (customer, amount, currency):
            raise ProviderError(f"provider: key {idempotency_key} was used for another charge")
        created = row[1].astimezone(timezone.utc).isoformat(timespec="milliseconds")
        return {"id": f"ch_{row[0]}", "created": created.replace("+00:00", "Z")}
