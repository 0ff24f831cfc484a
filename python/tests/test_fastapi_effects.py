"""What a FastAPI endpoint returns, over real HTTP (uvicorn on the loopback
interface) and the test server: a background task runs once, with the first
response; a response that is not JSON is stored and replayed; a value that
cannot be stored never makes the endpoint run twice; a route's checkpoint
is recorded by the claim's own statement; a route with a checkpoint and no
recover= is refused where it is declared."""

from __future__ import annotations

import os
from typing import Any

import httpx
import psycopg
import pytest
from conftest import new_key, serve, wait_for
from fastapi import FastAPI
from psycopg_pool import AsyncConnectionPool
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, PlainTextResponse, Response

import idempotency_pg as idem
from idempotency_pg.fastapi import IDEMPOTENCY_RESPONSES, idempotent_route

OP = "http.effects"
TYPE = "urn:idempotency:problem:"


def make_app(ran: list[str], tasks: list[str]) -> FastAPI:
    app = FastAPI()
    pools: list[AsyncConnectionPool] = []

    @app.on_event("startup")
    async def start() -> None:
        pool = AsyncConnectionPool("", min_size=1, max_size=4, open=False)
        await pool.open(wait=True)
        pools.append(pool)
        app.state.coordinator = idem.AsyncCoordinator(pool)

    @app.on_event("shutdown")
    async def stop() -> None:
        await app.state.coordinator.close()
        await pools[0].close()

    def coordinator() -> idem.AsyncCoordinator:
        c: idem.AsyncCoordinator = app.state.coordinator
        return c

    @app.post("/receipt", status_code=201, responses=IDEMPOTENCY_RESPONSES)
    @idempotent_route(OP + ".receipt", coordinator=coordinator, status_code=201)
    async def receipt(*, idempotency_key: str) -> Response:
        ran.append(idempotency_key)
        return JSONResponse({"id": idempotency_key}, 201,
                            background=BackgroundTask(tasks.append, idempotency_key))

    @app.post("/text")
    @idempotent_route(OP + ".text", coordinator=coordinator)
    async def text(*, idempotency_key: str) -> Response:
        ran.append(idempotency_key)
        return PlainTextResponse(f"made {idempotency_key}\n", 201, headers={"Location": "/x"})

    @app.post("/unencodable")
    @idempotent_route(OP + ".unencodable", coordinator=coordinator)
    async def unencodable(*, idempotency_key: str) -> Any:
        ran.append(idempotency_key)
        return {"handle": object()}     # no JSON form (pydantic 2 would send NaN as null)

    return app


def post(base: str, path: str, key: str) -> httpx.Response:
    return httpx.post(base + path, headers={"Idempotency-Key": key}, timeout=60)


def test_effects(admin: psycopg.Connection[Any]) -> None:
    ran: list[str] = []
    tasks: list[str] = []
    with serve(make_app(ran, tasks)) as base:
        # the background task runs once, with the first response, not on replays
        key = new_key("receipt")
        first = post(base, "/receipt", key)
        assert first.status_code == 201 and first.json() == {"id": key}
        wait_for("the background task", lambda: tasks == [key])
        again = post(base, "/receipt", key)
        assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
        assert ran == [key] and tasks == [key]

        # a response that is not JSON: stored as it was sent, replayed byte for byte
        key = new_key("text")
        first = post(base, "/text", key)
        assert (first.status_code, first.text) == (201, f"made {key}\n")
        again = post(base, "/text", key)
        assert (again.status_code, again.content) == (201, first.content)
        assert again.headers["content-type"] == first.headers["content-type"]
        assert again.headers["location"] == "/x" and again.headers["idempotent-replayed"] == "true"
        assert ran.count(key) == 1

        # a value the encoder refuses: nothing to send, but the endpoint ran: it never runs again
        key = new_key("unencodable")
        first = post(base, "/unencodable", key)
        assert first.status_code == 500 and first.json()["type"] == TYPE + "response-not-stored"
        for _ in range(2):
            again = post(base, "/unencodable", key)
            assert again.status_code == 410 and again.json()["type"] == TYPE + "response-not-stored"
            assert again.headers["idempotent-replayed"] == "true"
        assert ran.count(key) == 1


def test_checkpoint_in_the_claims_statement(admin: psycopg.Connection[Any], needs_1_4: None) -> None:
    """When the endpoint runs, its key has the route's checkpoint, and the
    claim's connection has run one statement of the claim: idem_begin, which
    recorded it (no second round trip)."""
    name = f"idem-ckpt-{os.getpid()}"
    operation = OP + ".ckpt"
    seen: list[tuple[list[str], Any]] = []
    app = FastAPI()
    pools: list[AsyncConnectionPool] = []

    @app.on_event("startup")
    async def start() -> None:
        pool = AsyncConnectionPool("", min_size=1, max_size=2, kwargs={"application_name": name}, open=False)
        await pool.open(wait=True)
        pools.append(pool)
        app.state.coordinator = idem.AsyncCoordinator(pool, claim_pool_size=1)

    @app.on_event("shutdown")
    async def stop() -> None:
        await app.state.coordinator.close()
        await pools[0].close()

    def coordinator() -> idem.AsyncCoordinator:
        c: idem.AsyncCoordinator = app.state.coordinator
        return c

    @app.post("/ckpt", status_code=201)
    @idempotent_route(operation, coordinator=coordinator, status_code=201,
                      checkpoint=lambda **_: {"step": "calling"}, recover=lambda state, **_: {"recovered": state})
    async def ckpt(*, idempotency_key: str) -> dict[str, Any]:
        async with await psycopg.AsyncConnection.connect("", autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT query FROM pg_stat_activity WHERE application_name = %s"
                " AND query ~ 'idem_begin\\(|idem_checkpoint\\(\\$1'", (name,))
            queries = [r[0] for r in await cur.fetchall()]
            cur = await conn.execute("SELECT checkpoint FROM idem_inspect(%s, %s)", (operation, idempotency_key))
            row = await cur.fetchone()
            seen.append((queries, row[0] if row else None))
        return {"id": idempotency_key}

    key = new_key("ckpt")
    with serve(app) as base:
        first = post(base, "/ckpt", key)
        again = post(base, "/ckpt", key)
    assert first.status_code == 201, first.text
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert len(seen) == 1, seen
    queries, checkpoint = seen[0]
    assert checkpoint == {"step": "calling"}
    assert len(queries) == 1 and "idem_begin(" in queries[0] and "idem_checkpoint(" in queries[0], queries


def test_checkpoint_without_recover_is_refused() -> None:
    with pytest.raises(TypeError, match="recover"):
        idempotent_route(OP, coordinator=lambda: None, checkpoint=lambda **_: {"step": 1})


def test_openapi(admin: psycopg.Connection[Any]) -> None:
    """The schema shows the Idempotency-Key header, the route's own status
    and the refusals it adds."""
    with serve(make_app([], [])) as base:
        schema = httpx.get(base + "/openapi.json", timeout=60).json()
    post = schema["paths"]["/receipt"]["post"]
    headers = [p for p in post["parameters"] if p["in"] == "header"]
    assert [h["name"] for h in headers] == ["Idempotency-Key"], post["parameters"]
    assert "200" not in post["responses"]
    assert {"201", "400", "409", "410", "422", "503"} <= set(post["responses"]), post["responses"]
    assert "application/problem+json" in post["responses"]["422"]["content"]
