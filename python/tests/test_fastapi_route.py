"""What an Idempotency-Key route does with what its endpoint (or its
``recover``) answers, in process (httpx's ASGI transport) against the test
server: a failing recovery keeps its checkpoint, the endpoint's own
checkpoint needs recover=, ..."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg
from conftest import arun, new_key, record_state
from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from test_async import open_pool

import idempotency_pg as idem
from idempotency_pg import current_claim
from idempotency_pg.fastapi import idempotent_route

OP = "http.route"
TYPE = "urn:idempotency:problem:"


def client_for(app: FastAPI) -> httpx.AsyncClient:
    """A client of ``app``; an exception of the app is its 500, as a server sends it."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def checkpoint_of(admin: psycopg.Connection[Any], operation: str, key: str) -> Any:
    row = admin.execute("SELECT checkpoint FROM idem_inspect(%s::text, %s::text)", (operation, key)).fetchone()
    return row[0] if row else None


def test_failing_recover_keeps_the_checkpoint(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """A recover handler that answers 503 or raises leaves the claim pending
    with its checkpoint: the next attempt gets 'recover' again, and the
    endpoint never runs a second time."""
    operation = OP + ".recover"
    ran: list[str] = []
    answers: list[int | None] = [503, None, 200]

    async def recover(state: Any, *, idempotency_key: str) -> Response:
        status = answers.pop(0)
        if status is None:
            raise RuntimeError("the provider does not answer")
        return JSONResponse({"recovered": state}, status)

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool, takeover="session") as c:
            app = FastAPI()

            @app.post("/recover")
            @idempotent_route(operation, coordinator=c, checkpoint=lambda **_: {"step": 1}, recover=recover)
            async def endpoint(*, idempotency_key: str) -> dict[str, Any]:
                ran.append(idempotency_key)
                return {"ran": True}

            key = new_key("recover")
            # an attempt that checkpointed and whose session ended
            claim = await c.begin(operation, key, idem.fingerprint())
            await claim.checkpoint({"step": 1})
            await claim.abandon()
            async with client_for(app) as client:
                for status in (503, 500):
                    r = await client.post("/recover", headers={"Idempotency-Key": key})
                    assert r.status_code == status
                    assert checkpoint_of(admin, operation, key) == {"step": 1}
                r = await client.post("/recover", headers={"Idempotency-Key": key})
                assert (r.status_code, r.json()) == (200, {"recovered": {"step": 1}})
                again = await client.post("/recover", headers={"Idempotency-Key": key})
                assert again.headers["idempotent-replayed"] == "true" and again.content == r.content
        assert ran == [] and answers == []
    arun(main())


def test_own_checkpoint_needs_recover(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """The endpoint's own checkpoint on a route without recover= is refused
    (TypeError: the endpoint fails, its claim is released)."""
    operation = OP + ".own-checkpoint"
    refused: list[str] = []

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as c:
            app = FastAPI()

            @app.post("/own")
            @idempotent_route(operation, coordinator=c)
            async def endpoint(*, idempotency_key: str) -> dict[str, Any]:
                try:
                    await current_claim().checkpoint({"step": 1})
                except TypeError as err:
                    refused.append(str(err))
                    raise
                return {"ran": True}

            key = new_key("own")
            async with client_for(app) as client:
                r = await client.post("/own", headers={"Idempotency-Key": key})
            assert r.status_code == 500 and "recover=" in refused[0]
            assert record_state(admin, operation, key) is None
    arun(main())
