"""The payments API in FastAPI: POST /charges with an Idempotency-Key header,
the same HTTP contract as examples/payments-api (Node.js), written with the
idempotency_pg package's decorator -- the external-call shape of README, "Two
usage shapes": claim the key (committed), call the provider passing the key
on, store the response (or release the claim if the provider failed).

Run: ``uvicorn --factory app:from_env`` with the libpq environment naming a
database that has ../payments-api/schema.sql.  Settings (all optional):
IN_FLIGHT=wait|raise, LEASE_S=30, WAIT_TIMEOUT_MS=10000 (longest a retry
waits for a running request before it gets 409), PROVIDER_DELAY_MS=300,
PROVIDER_FLAKY_CUSTOMERS=a,b, RECOVERY=off (no session takeover nor
checkpoints even when the extension has them).

Recovery (the extension's version 1.4 and later), as in
examples/payments-api/app.js: the claim is made with takeover => 'session',
and a checkpoint says the provider is about to be called with the key.  If
this process dies (kill -9, OOM) its connections close, the claim lapses at
once instead of after its lease, and the next attempt's idem_begin answers
'recover' with that checkpoint: the provider may have charged, so the new
owner (``recover_charge``) asks the provider for the charge made with the
key before charging, and finishes with it.  Against 1.3 the claim is a plain
leased one: a retry waits for the lease, then calls the provider again with
the same key, which the provider deduplicates.

Two pools, as README's rule says: a waiting claim holds its connection until
the first attempt finishes, so claims go through ``claim_pool`` and the
finish (and everything else) through ``pool``; a burst of retries can then
never keep the first attempt from storing its response.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta, timezone
from typing import Any, Dict, Optional, Tuple

import psycopg
from fastapi import FastAPI, Request
from psycopg_pool import AsyncConnectionPool
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse, Response

import idempotency_pg as idem
from idempotency_key import parse_idempotency_key
from problems import PROBLEM_TYPES, json_bytes, problem, problem_from_error
from provider import Provider, ProviderError

OPERATION = "payment.charge"
CURRENCY = re.compile(r"[A-Z]{3}")
MAX_AMOUNT = 99_999_999_999  # minor units
JSON = "application/json; charset=utf-8"
HAS_RECOVERY = "SELECT to_regprocedure('idem_checkpoint(text,text,bigint,jsonb)') IS NOT NULL"


def create_app(*, in_flight: str = "wait", lease: timedelta = timedelta(seconds=30),
               wait_timeout_ms: int = 10000, provider_delay_ms: int = 300,
               flaky_customers: Tuple[str, ...] = (), recovery: bool = False) -> FastAPI:
    """The API over the database the libpq environment names."""
    pool = AsyncConnectionPool("", min_size=2, max_size=10, open=False, name="payments-api")
    claim_pool = AsyncConnectionPool(
        "", min_size=2, max_size=10, open=False, name="payments-api claims",
        kwargs={"autocommit": True, "options": f"-c statement_timeout={int(wait_timeout_ms)}"})
    provider_pool = AsyncConnectionPool("", min_size=2, max_size=10, open=False, name="provider")
    coordinator = idem.AsyncCoordinator(pool, claim_pool=claim_pool, in_flight=in_flight, lease=lease,
                                        takeover="session" if recovery else None)
    provider = Provider(provider_pool, delay_ms=provider_delay_ms, flaky_customers=flaky_customers)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def record(result: Dict[str, Any], customer: str, amount: int, currency: str,
                     idempotency_key: str) -> Dict[str, Any]:
        """The API's own record of the charge the provider made, and the
        response to store (a retry that gets the same charge from the
        provider records it once)."""
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO charges (id, idempotency_key, customer, amount, currency, created_at)"
                " VALUES (%s::text, %s::text, %s::text, %s::bigint, %s::text, %s::timestamptz)"
                " ON CONFLICT (id) DO NOTHING",
                (result["id"], idempotency_key, customer, amount, currency, result["created"]))
        return {"status": 201, "headers": {"location": f"/charges/{result['id']}"},
                "body": {"id": result["id"], "object": "charge", "customer": customer,
                         "amount": amount, "currency": currency, "created": result["created"]}}

    async def recover_charge(state: Any, customer: str, amount: int, currency: str, *,
                             idempotency_key: str) -> Dict[str, Any]:
        """'recover': an attempt died after its checkpoint, maybe after the
        provider charged.  Ask the provider first; charge (with the same key,
        which it deduplicates) only if it has no charge for the key."""
        result = await provider.find(idempotency_key, customer, amount, currency)
        if result is None:
            result = await provider.charge(idempotency_key, customer, amount, currency)
        return await record(result, customer, amount, currency, idempotency_key)

    # The fingerprint covers what makes a charge *this* charge: a retry may
    # carry another description or trace id.
    @coordinator.idempotent(operation=OPERATION, fingerprint_params=("customer", "amount", "currency"),
                            recover=recover_charge)
    async def charge(customer: str, amount: int, currency: str, *, idempotency_key: str) -> Dict[str, Any]:
        if recovery:
            # what the next owner is told if this process dies from here on
            await idem.current_claim().checkpoint({"provider_key": idempotency_key})
        result = await provider.charge(idempotency_key, customer, amount, currency)
        return await record(result, customer, amount, currency, idempotency_key)

    @app.on_event("startup")
    async def open_pools() -> None:
        for p in (pool, claim_pool, provider_pool):
            await p.open(wait=True)

    @app.on_event("shutdown")
    async def close_pools() -> None:
        for p in (claim_pool, pool, provider_pool):
            await p.close()

    @app.post("/charges")
    async def post_charge(request: Request) -> Response:
        parsed = parse_idempotency_key(request.headers.getlist("idempotency-key"))
        if parsed.key is None:
            return problem(400, "idempotency-key-missing" if parsed.missing else "idempotency-key-malformed",
                           parsed.reason)
        try:
            body = json.loads(await request.body())
        except ValueError:
            return problem(400, "invalid-request", "The request body is not valid JSON.")
        error = validate_charge(body)
        if error:
            return problem(400, "invalid-request", error)
        try:
            outcome = await charge.outcome(body["customer"], body["amount"], body["currency"],
                                           idempotency_key=parsed.key)
        except ProviderError:
            # the decorator released the claim: errors are not cached
            return problem(502, "provider-unavailable", "The payment provider did not confirm the "
                           "charge. Retry with the same Idempotency-Key: the provider deduplicates "
                           "by it, so a charge it made is not made twice.")
        except Exception as err:  # noqa: BLE001 -- every other error is a problem document
            return problem_from_error(err)
        return stored_response(outcome.value, outcome.replayed)

    @app.get("/charges/{charge_id}")
    async def get_charge(charge_id: str) -> Response:
        row = None
        if re.fullmatch(r"ch_[1-9][0-9]{0,17}", charge_id):
            async with pool.connection() as conn:
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

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return problem(404, "not-found", f"No route for {request.method} {request.url.path}.")
        return problem(exc.status_code, "invalid-request", str(exc.detail))

    return app


def stored_response(stored: Dict[str, Any], replayed: bool) -> Response:
    """A stored response {status, headers, body}; a replay adds Idempotent-Replayed: true."""
    headers = dict(stored.get("headers") or {})
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return Response(json_bytes(stored["body"]), stored["status"], headers=headers, media_type=JSON)


def validate_charge(body: Any) -> Optional[str]:
    """None for a valid charge request, else what is wrong with it."""
    if not isinstance(body, dict):
        return "The request body must be a JSON object (Content-Type: application/json)."
    customer, amount, currency = body.get("customer"), body.get("amount"), body.get("currency")
    if not isinstance(customer, str) or not 1 <= len(customer) <= 255:
        return '"customer" must be a string of 1 to 255 characters.'
    if type(amount) is not int or not 1 <= amount <= MAX_AMOUNT:
        return f'"amount" must be an integer from 1 to {MAX_AMOUNT} (minor units, e.g. cents).'
    if not isinstance(currency, str) or not CURRENCY.fullmatch(currency):
        return '"currency" must be an ISO 4217 code such as "EUR".'
    return None


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
