"""idempotency_pg.fastapi against the real server: an app served in process
(httpx's ASGI transport), real concurrent requests, the README's SQLSTATE ->
HTTP table."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import psycopg
from conftest import arun, await_for, expire_completed, new_key, record_state
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response
from test_async import open_pool

import idempotency_pg as idem
from idempotency_pg.fastapi import idempotent_route, state_coordinator

OP = "http.items"
BIG = 2 ** 62 + 1   # no float keeps it


class Item(BaseModel):
    name: str
    qty: int
    note: str | None = None


class Made(BaseModel):
    name: str
    serial: int


def make_app(coordinator: idem.AsyncCoordinator, gate: asyncio.Event, calls: list[str]) -> FastAPI:
    app = FastAPI()
    app.state.coordinator = coordinator

    @app.post("/items")
    @idempotent_route(OP, coordinator=state_coordinator(), fingerprint=("item.name", "item.qty"),
                      problem_type_base="/problems/", remember=timedelta(days=30))
    async def create(item: Item, request: Request, *, idempotency_key: str) -> Response:
        calls.append(idempotency_key)
        if item.name == "slow":
            await gate.wait()
        if item.name == "broken":
            return Response(b'{"error": "down"}', 503, media_type="application/json")
        return Response(b'{"name": "%s", "serial": %d}' % (item.name.encode(), BIG), 201,
                        headers={"Location": f"/items/{item.name}", "ETag": '"v1"', "X-Trace": "t-1"},
                        media_type="application/json")

    def coordinator_of(request: Request) -> idem.AsyncCoordinator:
        c: idem.AsyncCoordinator = request.app.state.coordinator
        return c

    @app.post("/made", status_code=201)
    @idempotent_route("http.made", coordinator=coordinator_of, fingerprint=("item.name",),
                      in_flight="raise", lease=timedelta(seconds=40))
    async def made(item: Item = Depends()) -> Made:
        calls.append(item.name)
        if item.name == "slow":
            await gate.wait()
        return Made(name=item.name, serial=BIG)

    return app


async def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")  # type: ignore[arg-type]


def key_header(key: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{key}"'}


def test_routes(admin: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with await open_pool(3) as pool, idem.AsyncCoordinator(pool, claim_pool_size=4) as c:
            gate, calls = asyncio.Event(), []  # type: ignore[var-annotated]
            async with await client_for(make_app(c, gate, calls)) as client:
                body = {"name": "a", "qty": 2}
                # the header: 400 problem+json, before anything is claimed
                bad: list[dict[str, str]] = [{}, {"Idempotency-Key": '""'}, {"Idempotency-Key": "a b"},
                                             {"Idempotency-Key": '"' + "k" * 256 + '"'}]
                for headers in bad:
                    r = await client.post("/items", json=body, headers=headers)
                    assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json"
                    assert r.json()["type"] in ("/problems/idempotency-key-missing",
                                                "/problems/idempotency-key-malformed")
                assert calls == []
                # new, then replays: the status, Location and ETag only, Idempotent-Replayed
                key = new_key("item")
                first = await client.post("/items", json=body, headers=key_header(key))
                assert first.status_code == 201 and first.json()["serial"] == BIG
                assert (first.headers["location"], first.headers["etag"], first.headers["x-trace"]) == \
                    ("/items/a", '"v1"', "t-1")
                assert "idempotent-replayed" not in first.headers
                for _ in range(2):
                    again = await client.post("/items", json={**body, "note": "retry"}, headers=key_header(key))
                    assert (again.status_code, again.content) == (201, first.content)
                    assert again.headers["idempotent-replayed"] == "true"
                    assert (again.headers["location"], again.headers["etag"]) == ("/items/a", '"v1"')
                    assert "x-trace" not in again.headers
                assert type(again.json()["serial"]) is int and again.json()["serial"] == BIG
                # 422, both fingerprints
                reuse = await client.post("/items", json={**body, "qty": 3}, headers=key_header(key))
                assert reuse.status_code == 422 and reuse.headers["content-type"] == "application/problem+json"
                assert reuse.json()["stored_fingerprint"] == idem.fingerprint("a", 2).hex()
                assert reuse.json()["request_fingerprint"] == idem.fingerprint("a", 3).hex()
                # 410 once the response is past its ttl (the stage moves it, as test/demo does)
                expire_completed(admin, key)
                gone = await client.post("/items", json=body, headers=key_header(key))
                assert gone.status_code == 410 and gone.json()["type"] == "/problems/idempotency-key-expired"
                assert len(calls) == 1
                # a 5xx is sent, not stored: the retry runs again
                key = new_key("broken")
                for _ in range(2):
                    r = await client.post("/items", json={"name": "broken", "qty": 1}, headers=key_header(key))
                    assert r.status_code == 503 and "idempotent-replayed" not in r.headers
                assert record_state(admin, OP, key) is None and calls.count(key) == 2
                # a value: sent as JSON with status_code; 409 with Retry-After, an estimate of
                # the first attempt's end (1 with no attempt measured yet), not the 40 s lease
                key = new_key("made")
                slow = asyncio.ensure_future(client.post("/made", params={"name": "slow", "qty": 1},
                                                         headers=key_header(key)))
                await await_for("the first request runs", lambda: "slow" in calls)
                busy = await client.post("/made", params={"name": "slow", "qty": 1}, headers=key_header(key))
                assert busy.status_code == 409
                assert busy.json()["type"] == "urn:idempotency:problem:request-in-progress"
                assert busy.headers["retry-after"] == "1"
                gate.set()
                made = await slow
                assert made.status_code == 201 and made.json() == {"name": "slow", "serial": BIG}
                replay = await client.post("/made", params={"name": "slow", "qty": 1}, headers=key_header(key))
                assert (replay.status_code, replay.content) == (201, made.content)
                assert replay.headers["idempotent-replayed"] == "true"
    arun(main())
