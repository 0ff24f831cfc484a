"""A simulated payment provider: the external call the Idempotency-Key
protects.  It takes ``delay_ms`` to answer (300 ms, as in README's scenarios),
then records the charge in the ``charges`` table through its own pool,
outside any transaction of the API.

The API passes the Idempotency-Key on.  A real provider deduplicates on it;
this one, like examples/payments-api/provider.js, records every call, so a
double charge made by the API shows up as two rows and the test can count
them.  For ``flaky_customers`` the first call per key fails after the delay
without charging (a provider timeout): errors must not be cached."""

from __future__ import annotations

import asyncio
from datetime import timezone
from typing import Any, Dict, Iterable, Set

from psycopg_pool import AsyncConnectionPool


class ProviderError(Exception):
    """The provider did not confirm the charge; nothing was charged."""


class Provider:
    def __init__(self, pool: AsyncConnectionPool, *, delay_ms: int = 300,
                 flaky_customers: Iterable[str] = ()) -> None:
        self.pool = pool
        self.delay_ms = delay_ms
        self.flaky = set(flaky_customers)
        self.failed_once: Set[str] = set()

    async def charge(self, idempotency_key: str, customer: str, amount: int, currency: str) -> Dict[str, Any]:
        """Charge; returns ``{"id": "ch_N", "created": ISO time}``.  Raises ProviderError."""
        await asyncio.sleep(self.delay_ms / 1000)
        if customer in self.flaky and idempotency_key not in self.failed_once:
            self.failed_once.add(idempotency_key)
            raise ProviderError(f"provider timed out charging {customer}")
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "INSERT INTO charges (provider_key, customer, amount, currency)"
                " VALUES (%s::text, %s::text, %s::bigint, %s::text) RETURNING id, created_at",
                (idempotency_key, customer, amount, currency))
            row = await cur.fetchone()
        assert row is not None
        created = row[1].astimezone(timezone.utc).isoformat(timespec="milliseconds")
        return {"id": f"ch_{row[0]}", "created": created.replace("+00:00", "Z")}
