"""The payments API in FastAPI: POST /charges with an Idempotency-Key header,
the same HTTP contract as examples/payments-api (Node.js), written with the
idempotency_pg package's FastAPI integration (``idempotency_pg.fastapi``) --
the external-call shape of README, "Two usage shapes": claim the key
(committed), call the provider passing the key on, store the response (or
release the claim if the provider failed).  The integration parses the
header, maps the refusals to HTTP and replays stored responses; the route is
decorated where it is defined, and its coordinator, made at start-up with
the pools, reaches it through a FastAPI dependency (``app.state``).

Run: ``uvicorn --factory app:from_env`` with the libpq environment naming a
database that has ../payments-api/schema.sql.  Settings (all optional):
IN_FLIGHT=wait|raise, LEASE_S=30, WAIT_TIMEOUT_MS=10000 (longest a retry
waits for a running request before it gets 409: the coordinator's
wait_timeout), PROVIDER_DELAY_MS=300,
PROVIDER_FLAKY_CUSTOMERS=a,b, RECOVERY=off (no session takeover nor
checkpoints even when the extension has them).

Recovery (the extension's version 1.4 and later), as in
examples/payments-api/app.js: the claim is made with takeover => 'session',
and a checkpoint says the provider is about to be called with the key.  If
this process dies (kill -9, OOM) its connections close, the claim lapses at
once instead of after its lease, and the next attempt's idem_begin answers
'recover' with that checkpoint: the provider may have charged, so the new
owner (``recover_charge``) asks the provider for the charge made with the
key before charging, and finishes with it.  (idempotency_pg needs the
extension's 1.4 API: its first call checks the installed version.)

Two pools, as README's rule says: a waiting claim holds its connection until
the first attempt finishes, so claims go through ``claim_pool`` and
everything else through ``pool``; a burst of retries can then never keep the
first attempt from storing its response.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import AsyncIterator
from datetime import timedelta, timezone
from typing import Any

import psycopg
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, StrictInt, StrictStr
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse, Response

import idempotency_pg as idem
from idempotency_pg.fastapi import idempotent_route, state_coordinator
from idempotency_pg.http import json_bytes
from problems import PROBLEM_BASE, PROBLEM_TYPES, problem
from provider import Provider, ProviderError

OPERATION = "payment.charge"
CURRENCY = re.compile(r"[A-Z]{3}")
MAX_AMOUNT = 99_999_999_999  # minor units
JSON = "application/json; charset=utf-8"
HAS_RECOVERY = "SELECT to_regprocedure('idem_checkpoint(text,text,bigint,jsonb)') IS NOT NULL"


class ChargeIn(BaseModel):
    """POST /charges' body.  Strict types: an amount is an integer of minor
    units, never a float nor a string of digits."""

    customer: StrictStr
    amount: StrictInt
    currency: StrictStr
    description: StrictStr | None = None


def valid_charge(charge: ChargeIn) -> ChargeIn:
    """The body, checked before anything is claimed: a 400 does not use up
    the key.  (The ranges are checked here, the same way in pydantic 1 and 2.)"""
    if not 1 <= len(charge.customer) <= 255:
        raise HTTPException(400, '"customer" must be a string of 1 to 255 characters.')
    if not 1 <= charge.amount <= MAX_AMOUNT:
        raise HTTPException(400, f'"amount" must be an integer from 1 to {MAX_AMOUNT} (minor units, e.g. cents).')
    if not CURRENCY.fullmatch(charge.currency):
        raise HTTPException(400, '"currency" must be an ISO 4217 code such as "EUR".')
    return charge


def create_app(*, in_flight: str = "wait", lease: timedelta = timedelta(seconds=30),
               wait_timeout_ms: int = 10000, provider_delay_ms: int = 300,
               flaky_customers: tuple[str, ...] = (), recovery: bool = False) -> FastAPI:
    """The API over the database the libpq environment names."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the pools and the coordinator exist from here on; the route reads
        # the coordinator from app.state at each request
        pool = AsyncConnectionPool("", min_size=2, max_size=10, open=False, name="payments-api")
        claim_pool = AsyncConnectionPool("", min_size=2, max_size=10, open=False,
                                         name="payments-api claims", kwargs={"autocommit": True})
        provider_pool = AsyncConnectionPool("", min_size=2, max_size=10, open=False, name="provider")
        for p in (pool, claim_pool, provider_pool):
            await p.open(wait=True)
        app.state.pool = pool
        app.state.coordinator = idem.AsyncCoordinator(
            pool, claim_pool=claim_pool, in_flight=in_flight, lease=lease,
            wait_timeout=timedelta(milliseconds=wait_timeout_ms),
            takeover="session" if recovery else None)
        app.state.provider = Provider(provider_pool, delay_ms=provider_delay_ms,
                                      flaky_customers=flaky_customers)
        try:
            yield
        finally:
            for p in (claim_pool, pool, provider_pool):
                await p.close()

    if "lifespan" in inspect.signature(FastAPI).parameters:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)
    else:
        # FastAPI before 0.93 (Debian 12 has 0.92) takes the lifespan on its
        # Starlette router
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        app.router.lifespan_context = lifespan

    async def record(request: Request, result: dict[str, Any], charge: ChargeIn,
                     idempotency_key: str) -> Response:
        """The API's own record of the charge the provider made, and the
        response (a retry that gets the same charge from the provider
        records it once).  The integration stores its status, its Location
        and its body, and sends them as stored."""
        async with request.app.state.pool.connection() as conn:
            await conn.execute(
                "INSERT INTO charges (id, idempotency_key, customer, amount, currency, created_at)"
                " VALUES (%s::text, %s::text, %s::text, %s::bigint, %s::text, %s::timestamptz)"
                " ON CONFLICT (id) DO NOTHING",
                (result["id"], idempotency_key, charge.customer, charge.amount, charge.currency,
                 result["created"]))
        body = {"id": result["id"], "object": "charge", "customer": charge.customer,
                "amount": charge.amount, "currency": charge.currency, "created": result["created"]}
        return Response(json_bytes(body), 201, headers={"Location": f"/charges/{result['id']}"},
                        media_type=JSON)

    async def recover_charge(state: Any, request: Request, charge: ChargeIn, *,
                             idempotency_key: str) -> Response:
        """'recover': an attempt died after its checkpoint, maybe after the
        provider charged.  Ask the provider first; charge (with the same key,
        which it deduplicates) only if it has no charge for the key."""
        provider: Provider = request.app.state.provider
        result = await provider.find(idempotency_key, charge.customer, charge.amount, charge.currency)
        if result is None:
            result = await provider.charge(idempotency_key, charge.customer, charge.amount, charge.currency)
        return await record(request, result, charge, idempotency_key)

    # The fingerprint covers what makes a charge *this* charge: a retry may
    # carry another description or trace id.
    @app.post("/charges")
    @idempotent_route(OPERATION, coordinator=state_coordinator("coordinator"),
                      fingerprint=("charge.customer", "charge.amount", "charge.currency"),
                      recover=recover_charge, problem_type_base=PROBLEM_BASE, media_type=JSON)
    async def post_charge(request: Request, charge: ChargeIn = Depends(valid_charge), *,
                          idempotency_key: str) -> Response:
        if recovery:
            # what the next owner is told if this process dies from here on
            await idem.current_claim().checkpoint({"provider_key": idempotency_key})
        provider: Provider = request.app.state.provider
        result = await provider.charge(idempotency_key, charge.customer, charge.amount, charge.currency)
        return await record(request, result, charge, idempotency_key)

    @app.get("/charges/{charge_id}")
    async def get_charge(request: Request, charge_id: str) -> Response:
        row = None
        if re.fullmatch(r"ch_[1-9][0-9]{0,17}", charge_id):
            async with request.app.state.pool.connection() as conn:
                cur = await conn.execute("SELECT id, customer, amount, currency, created_at FROM charges"
                                         " WHERE id = %s::text", (charge_id,))
                row = await cur.fetchone()
        if row is None:
            return problem(404, "not-found", f"There is no charge {charge_id}.")
        created = row[4].astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return Response(json_bytes({"id": row[0], "object": "charge", "customer": row[1],
                                    "amount": row[2], "currency": row[3], "created": created}),
                        media_type=JSON)

    @app.get("/problems/{type_}")
    async def problem_doc(type_: str) -> Response:
        t = PROBLEM_TYPES.get(type_)
        if t is None:
            return problem(404, "not-found", "No such problem type.")
        return PlainTextResponse(f"{t['title']}\n\n{t['doc']}\n")

    @app.exception_handler(ProviderError)
    async def provider_error(request: Request, exc: ProviderError) -> Response:
        # the integration released the claim: errors are not cached
        return problem(502, "provider-unavailable", "The payment provider did not confirm the "
                       "charge. Retry with the same Idempotency-Key: the provider deduplicates "
                       "by it, so a charge it made is not made twice.")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        return problem(400, "invalid-request", "The request body must be a JSON object "
                       '{"customer": string, "amount": integer, "currency": ISO 4217 code}: '
                       + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return problem(404, "not-found", f"No route for {request.method} {request.url.path}.")
        return problem(exc.status_code, "invalid-request", str(exc.detail))

    return app


def has_recovery() -> bool:
    """Whether the database's extension has session takeover and checkpoints
    (version 1.4 and later)."""
    with psycopg.connect("") as conn:
        row = conn.execute(HAS_RECOVERY).fetchone()
    return bool(row and row[0])


def from_env() -> FastAPI:
    """The app configured from the environment (``uvicorn --factory app:from_env``)."""
    env = os.environ
    return create_app(
        recovery=env.get("RECOVERY") != "off" and has_recovery(),
        in_flight=env.get("IN_FLIGHT", "wait"),
        lease=timedelta(seconds=float(env.get("LEASE_S", "30"))),
        wait_timeout_ms=int(env.get("WAIT_TIMEOUT_MS", "10000")),
        provider_delay_ms=int(env.get("PROVIDER_DELAY_MS", "300")),
        flaky_customers=tuple(c for c in env.get("PROVIDER_FLAKY_CUSTOMERS", "").split(",") if c))
