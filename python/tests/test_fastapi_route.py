"""What an Idempotency-Key route does with what its endpoint (or its
``recover``) answers, in process (httpx's ASGI transport) against the test
server: a failing recovery keeps its checkpoint, the endpoint's own
checkpoint needs recover=, ..."""

from __future__ import annotations

import functools
import gzip
from collections.abc import Awaitable, Callable
from typing import Any, Optional, Union

import httpx
import psycopg
import pytest
from conftest import arun, new_key, record_state
from fastapi import Body, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response
from test_async import open_pool

import idempotency_pg as idem
from idempotency_pg import current_claim
from idempotency_pg.fastapi import idempotent_route
from idempotency_pg.http import problem_for

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


class UserIn(BaseModel):
    name: str
    password: str


class UserOut(BaseModel):
    name: str


def answers_app(c: idem.AsyncCoordinator, ran: list[str]) -> FastAPI:
    """Routes whose answers a plain FastAPI route would send alike."""
    app = FastAPI()

    @app.delete("/thing", status_code=204)
    @idempotent_route(OP + ".204", coordinator=c)
    async def delete(*, idempotency_key: str) -> None:
        ran.append("204")

    @app.post("/users", status_code=201, response_model=UserOut)
    @idempotent_route(OP + ".users", coordinator=c)
    async def users(user: UserIn, *, idempotency_key: str) -> Any:
        ran.append("users")
        return user

    @app.post("/made", status_code=201)
    @idempotent_route(OP + ".made", coordinator=c)
    def made(user: UserOut, *, idempotency_key: str) -> UserOut:      # FastAPI's threadpool runs it
        ran.append("made")
        return user

    @app.post("/bytes", status_code=201)
    @idempotent_route(OP + ".bytes", coordinator=c, replay_headers=("Link", "Content-Type", "Location"))
    async def raw(*, idempotency_key: str) -> Response:
        ran.append("bytes")
        response = Response(b"abc\x00def", 201)
        response.headers.append("Link", "</a>; rel=a")
        response.headers.append("Link", "</b>; rel=b")
        response.headers.append("Location", "/bytes/1")
        return response

    @app.post("/gzipped")
    @idempotent_route(OP + ".gzipped", coordinator=c, replay_headers=("Location",))
    async def gzipped(*, idempotency_key: str) -> Response:
        ran.append("gzipped")
        headers = {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"}
        return Response(gzip.compress(b'{"id":1}'), 200, headers, media_type="application/json")

    @app.post("/declined")
    @idempotent_route(OP + ".declined", coordinator=c)
    async def declined(fail: int, *, idempotency_key: str) -> None:
        ran.append("declined")
        raise HTTPException(fail, "card declined")

    @app.exception_handler(409)
    async def conflict(request: Request, exc: HTTPException) -> Response:
        return JSONResponse({"conflict": exc.detail}, 409)

    return app


def test_answers_as_fastapi(admin: psycopg.Connection[Any]) -> None:
    """The route's status_code and response_model; a 204 without a body; a
    sync endpoint; a body with a NUL; a repeated header; an HTTPException
    of a status that is stored."""
    ran: list[str] = []

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as c:
            async with client_for(answers_app(c, ran)) as client:
                async def twice(method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, httpx.Response]:
                    headers = {"Idempotency-Key": new_key(path[1:])}
                    first = await client.request(method, path, headers=headers, **kwargs)
                    again = await client.request(method, path, headers=headers, **kwargs)
                    assert "idempotent-replayed" not in first.headers
                    assert again.headers.get("idempotent-replayed") == "true", again
                    assert (again.status_code, again.content) == (first.status_code, first.content)
                    return first, again

                first, again = await twice("DELETE", "/thing")
                assert (first.status_code, first.content) == (204, b"")
                assert again.headers.get("content-type") == first.headers.get("content-type")
                first, again = await twice("POST", "/users", json={"name": "n", "password": "secret"})
                assert (first.status_code, first.json()) == (201, {"name": "n"})
                first, again = await twice("POST", "/made", json={"name": "m"})
                assert (first.status_code, first.json()) == (201, {"name": "m"})
                first, again = await twice("POST", "/bytes")
                assert first.content == b"abc\x00def" and "content-type" not in again.headers
                for r in (first, again):
                    assert r.headers.get_list("link") == ["</a>; rel=a", "</b>; rel=b"]
                    assert r.headers["location"] == "/bytes/1"
                # what the stored bytes are is kept whatever replay_headers says
                first, again = await twice("POST", "/gzipped")
                for r in (first, again):
                    assert (r.headers["content-encoding"], r.headers["vary"]) == ("gzip", "Accept-Encoding")
                    assert r.headers["content-type"] == "application/json" and r.json() == {"id": 1}
                first, again = await twice("POST", "/declined", params={"fail": 402})
                assert first.status_code == 402 and first.json() == {"detail": "card declined"}
                first, again = await twice("POST", "/declined", params={"fail": 409})
                assert first.json() == {"conflict": "card declined"}
                # a status that is not stored: released, the retry runs again
                headers = {"Idempotency-Key": new_key("declined")}
                for _ in range(2):
                    r = await client.post("/declined", params={"fail": 503}, headers=headers)
                    assert r.status_code == 503 and "idempotent-replayed" not in r.headers
        assert sorted(ran) == ["204", "bytes", "declined", "declined", "declined", "declined", "gzipped", "made",
                               "users"]
    arun(main())


def test_openapi_of_the_route() -> None:
    """OpenAPI shows the route's status and its response model, as for a
    plain route."""
    app = FastAPI()

    @app.post("/users", status_code=201, response_model=UserOut)
    @idempotent_route(OP, coordinator=lambda: None)
    async def users(user: UserIn, *, idempotency_key: str) -> Any:
        return user

    @app.post("/made", status_code=201)
    @idempotent_route(OP, coordinator=lambda: None)
    async def made(*, idempotency_key: str) -> UserOut:
        return UserOut(name="m")

    paths = app.openapi()["paths"]
    for path in ("/users", "/made"):
        responses = paths[path]["post"]["responses"]
        assert list(responses) == ["201", "422"], responses
        assert responses["201"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/UserOut"}


def test_status_code_mismatch_is_refused(admin: psycopg.Connection[Any]) -> None:
    """A status_code= of the route's that FastAPI's route does not declare
    would answer another status than OpenAPI says: refused."""
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as c:
            app = FastAPI()

            @app.post("/made")
            @idempotent_route(OP + ".mismatch", coordinator=c, status_code=201)
            async def made(*, idempotency_key: str) -> dict[str, Any]:
                return {}

            transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                for _ in range(2):
                    with pytest.raises(TypeError, match="status_code"):
                        await client.post("/made", headers={"Idempotency-Key": new_key("mismatch")})
    arun(main())


# int | float, not int: pydantic 2 refuses 42.5 for an int itself (the
# framework's 422, before the route runs) and pydantic 1 turns it into 42;
# with both, the route's own check of the value as sent answers 400
class Charge(BaseModel):
    amount: int | float


class Aliased(BaseModel):
    amount: int | float = Field(alias="amountCents")


class Other(BaseModel):
    cents: int


def test_values_as_sent(admin: psycopg.Connection[Any]) -> None:
    """A fingerprinted body value is read as the client sent it however
    FastAPI finds it (an embedded body, an alias, an Optional or a Union
    body): 42.5 is refused, never fingerprinted as pydantic's 42."""
    ran: list[str] = []

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as c:
            app = FastAPI()

            @app.post("/embed")
            @idempotent_route(OP + ".embed", coordinator=c, fingerprint=("charge.amount",))
            async def embed(charge: Charge = Body(embed=True), *, idempotency_key: str) -> dict[str, float]:
                ran.append("embed")
                return {"amount": charge.amount}

            @app.post("/alias")
            @idempotent_route(OP + ".alias", coordinator=c, fingerprint=("charge.amount",))
            async def alias(charge: Aliased, *, idempotency_key: str) -> dict[str, float]:
                ran.append("alias")
                return {"amount": charge.amount}

            @app.post("/optional")
            @idempotent_route(OP + ".optional", coordinator=c, fingerprint=("charge.amount",))
            async def optional(charge: Optional[Charge] = None, *, idempotency_key: str) -> dict[str, Any]:
                ran.append("optional")
                return {"amount": charge.amount if charge else None}

            @app.post("/union")
            @idempotent_route(OP + ".union", coordinator=c, fingerprint=("charge.amount",))
            async def union(charge: Union[Charge, Other], *, idempotency_key: str) -> dict[str, Any]:
                ran.append("union")
                return {"amount": getattr(charge, "amount", None)}

            sent: dict[str, Callable[[float], Any]] = {
                "/embed": lambda amount: {"charge": {"amount": amount}},
                "/alias": lambda amount: {"amountCents": amount},
                "/optional": lambda amount: {"amount": amount},
                "/union": lambda amount: {"amount": amount}}
            async with client_for(app) as client:
                for path, body in sent.items():
                    headers = {"Idempotency-Key": new_key(path[1:])}
                    r = await client.post(path, json=body(42.5), headers=headers)
                    assert r.status_code == 400 and r.json()["type"] == TYPE + "invalid-request", (path, r.text)
                    assert (await client.post(path, json=body(42), headers=headers)).status_code == 200
                    replay = await client.post(path, json=body(42.0), headers=headers)
                    assert replay.headers["idempotent-replayed"] == "true", path
                    reuse = await client.post(path, json=body(43), headers=headers)
                    assert reuse.status_code == 422, path
                r = await client.post("/optional", headers={"Idempotency-Key": new_key("none")})
                assert (r.status_code, r.json()) == (200, {"amount": None})
        assert sorted(ran) == ["alias", "embed", "optional", "optional", "union"]
    arun(main())


def test_the_route_that_serves_the_request(admin: psycopg.Connection[Any]) -> None:
    """The FastAPI route that serves the request gives the status: one
    endpoint in two apps with two status codes, the second behind another
    decorator; the headers the endpoint sets on its Response parameter go
    with its value, stored and replayed."""
    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as c:
            @idempotent_route(OP + ".shared", coordinator=c)
            async def shared(response: Response, *, idempotency_key: str) -> dict[str, str]:
                response.headers["Location"] = f"/things/{idempotency_key}"
                return {"key": idempotency_key}

            def logged(func: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
                @functools.wraps(func)
                async def wrapper(*args: Any, **kwargs: Any) -> Any:
                    return await func(*args, **kwargs)
                return wrapper

            one, two = FastAPI(), FastAPI()
            one.post("/things", status_code=201)(shared)
            two.post("/things", status_code=202)(logged(shared))
            for app, status in ((one, 201), (two, 202)):
                async with client_for(app) as client:
                    key = new_key("shared")
                    first = await client.post("/things", headers={"Idempotency-Key": key})
                    again = await client.post("/things", headers={"Idempotency-Key": key})
                    for r in (first, again):
                        expected = (status, f"/things/{key}", {"key": key})
                        assert (r.status_code, r.headers["location"], r.json()) == expected, r
                    assert again.headers["idempotent-replayed"] == "true"
    arun(main())


def test_problem_for_a_result_not_stored() -> None:
    """The decorator's ResponseNotStoredError is docs/http.md's
    response-not-stored: 500 for the attempt (its detail saying whether the
    result is stored later), 410 for a later attempt."""
    def error(**flags: bool) -> idem.ResponseNotStoredError:
        return idem.ResponseNotStoredError("op", "k", 1, None, "cause", sqlstate=None, detail=None,
                                           checkpointed=True, **flags)
    cases: dict[str, dict[str, bool]] = {"now": {}, "later": {"storing": True}, "completed": {"completed": True}}
    answers = {name: problem_for(error(**flags)) for name, flags in cases.items()}
    assert {name: (p.status, p.slug) for name, p in answers.items() if p} == {
        "now": (500, "response-not-stored"), "later": (500, "response-not-stored"),
        "completed": (410, "response-not-stored")}
    assert answers["later"] != answers["now"]


def test_head_runs_without_idempotency(admin: psycopg.Connection[Any]) -> None:
    """A HEAD request, safe by definition, runs without a claim, as in the
    Node package; a GET with the same key then runs as new."""
    ran: list[str | None] = []

    async def main() -> None:
        async with await open_pool(2) as pool, idem.AsyncCoordinator(pool) as c:
            app = FastAPI()

            @app.api_route("/thing", methods=["GET", "HEAD"])
            @idempotent_route(OP + ".head", coordinator=c)
            async def thing(*, idempotency_key: str | None) -> dict[str, int]:
                ran.append(idempotency_key)
                return {"n": len(ran)}

            key = new_key("head")
            async with client_for(app) as client:
                head = await client.head("/thing", headers={"Idempotency-Key": key})
                assert head.status_code == 200 and "idempotent-replayed" not in head.headers
                assert record_state(admin, OP + ".head", key) is None, "nothing claimed"
                first = await client.get("/thing", headers={"Idempotency-Key": key})
                again = await client.get("/thing", headers={"Idempotency-Key": key})
                assert (first.json(), again.json()) == ({"n": 2}, {"n": 2})
                assert again.headers["idempotent-replayed"] == "true"
        assert ran == [key, key]
    arun(main())
