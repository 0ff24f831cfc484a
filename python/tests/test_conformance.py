"""The conformance cases of docs/http.md (test/http/cases.json, the file the
Node package's suite runs too) against a small FastAPI app built as the
file's "app" says, served by uvicorn on the loopback interface, over a
database of its own on the test server.  Real HTTP, real concurrent
requests; every case also counts the handler's runs in the database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from conftest import DEADLINE_S, Server, install_edition, is_schema_statement, own_server_running, serve
from fastapi import FastAPI
from psycopg import sql
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from starlette.responses import Response

import idempotency_pg as idem
from idempotency_pg.fastapi import idempotent_route
from idempotency_pg.http import TITLES, json_bytes

CASES_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "test", "http", "cases.json")
with open(CASES_FILE, encoding="utf-8") as f:
    CASES: dict[str, Any] = json.load(f)
BASE = "urn:idempotency:problem:"
UNREACHABLE = "host=/nonexistent-idempotency-test-socket-dir port=1 connect_timeout=1"


class Body(BaseModel):
    customer: str
    # int | float, not int: pydantic 2 refuses 42.5 for an int itself (the
    # framework's 422, before the route runs) and pydantic 1 turns it into 42;
    # with both, the package's own check of the value as sent answers 400
    amount: int | float
    hold: int | None = None
    hold_after: int | None = None
    answer: int | str | None = None
    style: str | None = None


def conninfo(db: str, application: str) -> str:
    return psycopg.conninfo.make_conninfo("", dbname=db, application_name=application)


def make_app(db: str) -> FastAPI:
    """The app of cases.json's "app": every route's handler as "handler"
    says; claims on the pool named conformance-claims."""
    app = FastAPI()
    pools: dict[str, AsyncConnectionPool] = {}
    coordinators: dict[str, idem.AsyncCoordinator] = {}

    @app.on_event("startup")      # FastAPI 0.92 (Debian 12) has no lifespan=
    async def start() -> None:
        pools["app"] = AsyncConnectionPool(conninfo(db, "conformance-app"), min_size=1, max_size=12,
                                           open=False)
        pools["idem"] = AsyncConnectionPool(conninfo(db, "conformance-idem"), min_size=1, max_size=12,
                                            open=False)
        pools["claims"] = AsyncConnectionPool(conninfo(db, "conformance-claims"), min_size=1, max_size=12,
                                              kwargs={"autocommit": True}, open=False)
        pools["down"] = AsyncConnectionPool(UNREACHABLE, min_size=1, max_size=1, timeout=0.5,
                                            reconnect_timeout=0.5, open=False)
        for name in ("app", "idem", "claims"):
            await pools[name].open(wait=True)
        await pools["down"].open(wait=False)
        coordinators["db"] = idem.AsyncCoordinator(pools["idem"], claim_pool=pools["claims"])
        coordinators["down"] = idem.AsyncCoordinator(pools["down"], claim_pool_size=1)

    @app.on_event("shutdown")
    async def stop() -> None:
        for c in coordinators.values():
            await c.close()
        for p in pools.values():
            await p.close()

    def db_coordinator() -> idem.AsyncCoordinator:
        return coordinators["db"]

    def down_coordinator() -> idem.AsyncCoordinator:
        return coordinators["down"]

    @contextlib.asynccontextmanager
    async def app_connection() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A working connection of the handlers' pool: one a server restart
        ended is discarded (psycopg_pool 3.1 has no check=)."""
        for _ in range(3):
            async with pools["app"].connection() as conn:
                try:
                    await conn.execute("SELECT 1")
                except psycopg.OperationalError:
                    continue
                yield conn
                return
        raise RuntimeError("no working connection in the handlers' pool")

    async def handler(body: Body, key: str | None) -> Any:
        async with app_connection() as conn:
            if body.hold is not None:
                await conn.execute("SELECT pg_advisory_xact_lock_shared(4242, %s::int)", (body.hold,))
            await conn.execute("INSERT INTO conformance_runs VALUES (%s::text, 'handler')", (key or "",))
        if body.hold_after is not None:
            # only a pause after the effect: a restart ends the wait, and the
            # handler goes on once the server answers again
            try:
                async with app_connection() as conn:
                    await conn.execute("SELECT pg_advisory_xact_lock_shared(4242, %s::int)", (body.hold_after,))
            except psycopg.Error:
                while True:
                    try:
                        async with await psycopg.AsyncConnection.connect(conninfo(db, "conformance-app")) as conn:
                            await conn.execute("SELECT 1")
                        break
                    except psycopg.Error:
                        await asyncio.sleep(0.05)
        if body.answer is None:
            return Response(json_bytes({"zeta": "last", "id": f"ch_{key}", "amount": body.amount,
                                        "alpha": "first"}), 201,
                            headers={"Location": f"/charges/{key}", "ETag": '"v1"'}, media_type="application/json")
        if body.answer == "throw":
            raise RuntimeError("the handler throws")
        if body.answer == "empty":
            return Response(status_code=204)
        if body.answer == "large":
            return Response(json_bytes({"id": f"ch_{key}", "padding": "x" * 70000}), 201,
                            media_type="application/json")
        status = int(body.answer)
        return Response(json_bytes({"error": "answer", "status": status}), status, media_type="application/json")

    async def recover(state: Any, body: Body, *, idempotency_key: str) -> Response:
        async with app_connection() as conn:
            await conn.execute("INSERT INTO conformance_runs VALUES (%s::text, 'recover')", (idempotency_key,))
        return Response(json_bytes({"recovered": state}), 200, media_type="application/json")

    routes: dict[str, dict[str, Any]] = CASES["app"]["routes"]
    for path, spec in routes.items():
        options: dict[str, Any] = {
            "coordinator": down_coordinator if "database" in spec else db_coordinator,
            "fingerprint": tuple(spec["fingerprint"]),
            "in_flight": spec.get("inFlight"), "takeover": spec.get("takeover"),
            "lease": spec.get("lease"), "required": spec.get("required", True),
            "on_store_error": spec.get("onStoreError", "raise"),
        }
        if "waitTimeout" in spec:
            options["wait_timeout"] = timedelta(seconds=float(spec["waitTimeout"].split()[0]))
        if "checkpoint" in spec:
            options["checkpoint"] = lambda body, **_: {"customer": body.customer}
            options["recover"] = recover

        async def endpoint(body: Body, *, idempotency_key: str | None) -> Any:
            return await handler(body, idempotency_key)

        app.post(path)(idempotent_route(spec["operation"], **options)(endpoint))
    return app


@dataclass
class Served:
    base: str
    db: psycopg.Connection[Any]
    gates: psycopg.Connection[Any]
    dbname: str
    named: dict[str, httpx.Response] = field(default_factory=dict)
    started: dict[str, Future[httpx.Response]] = field(default_factory=dict)
    #: the process cases': the server of the runner's own, the app's process
    own: Server | None = None
    app: subprocess.Popen[bytes] | None = None

    def connect(self, application: str) -> psycopg.Connection[Any]:
        server = "" if self.own is None else self.own.conninfo
        return psycopg.connect(psycopg.conninfo.make_conninfo(server, dbname=self.dbname,
                                                              application_name=application), autocommit=True)


@pytest.fixture(scope="module")
def served(admin: psycopg.Connection[Any]) -> Iterator[Served]:
    """A new database with the app's schema, and the app served on
    127.0.0.1 by uvicorn in a thread of its own."""
    dbname = f"conformance_{os.getpid()}"
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        install_edition(conninfo(dbname, "conformance-runner"))
        with psycopg.connect(conninfo(dbname, "conformance-runner"), autocommit=True) as db, \
                psycopg.connect(conninfo(dbname, "conformance-gates"), autocommit=True) as gates:
            for statement in filter(is_schema_statement, CASES["app"]["schema"]):
                db.execute(statement)
            with serve(make_app(dbname)) as base:
                yield Served(base, db, gates, dbname)
    finally:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(dbname)))


def send(s: Served, request: dict[str, Any]) -> httpx.Response:
    headers = {} if "key" not in request else {"Idempotency-Key": request["key"]}
    with httpx.Client(timeout=60) as client:
        return client.post(s.base + request["route"], json=request["body"], headers=headers)


def check(s: Served, r: httpx.Response, expect: dict[str, Any], what: str) -> None:
    where = f"{what}: {r.status_code} {r.headers} {r.text[:300]}"
    if "status" in expect:
        assert r.status_code == expect["status"], where
    for name, value in expect.get("headers", {}).items():
        assert r.headers.get(name) == value, f"header {name}: {where}"
    if "content_type" in expect:
        assert r.headers.get("content-type", "").split(";")[0].strip() == expect["content_type"], where
    if "problem" in expect:
        assert r.json()["type"] == BASE + expect["problem"], where
        assert r.json()["title"] == CASES["titles"][expect["problem"]], where
    for member in expect.get("problem_members", []):
        assert member in r.json(), where
    if "body_text" in expect:
        assert r.text == expect["body_text"], where
    if "same_text_as" in expect:
        assert r.content == s.named[expect["same_text_as"]].content, where
    if "retry_after" in expect:
        low, high = expect["retry_after"]
        assert low <= int(r.headers["retry-after"]) <= high, where


def test_titles() -> None:
    """Every problem type's title is the one both packages answer with."""
    assert TITLES == CASES["titles"]


def poll(what: str, s: Served, query: str, params: tuple[Any, ...], at_least: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        row = s.db.execute(query, params).fetchone()
        if row is not None and row[0] >= at_least:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        time.sleep(0.01)


def run_step(s: Served, step: dict[str, Any], pool: ThreadPoolExecutor) -> None:
    expect = step.get("expect", {})
    if "send" in step and "concurrent" in step:
        futures = [pool.submit(send, s, step["send"]) for _ in range(step["concurrent"])]
        answers = [f.result() for f in futures]
        for r in answers:
            check(s, r, expect, "concurrent")
        if step.get("one_text"):
            assert len({r.content for r in answers}) == 1
    elif "send" in step:
        r = send(s, step["send"])
        check(s, r, expect, json.dumps(step["send"])[:200])
        if "as" in step:
            s.named[step["as"]] = r
    elif "start" in step:
        s.started[step["as"]] = pool.submit(send, s, step["start"])
    elif "await" in step and expect.get("no_answer"):
        with pytest.raises(httpx.TransportError):
            s.started.pop(step["await"]).result(timeout=60)
    elif "await" in step:
        r = s.started.pop(step["await"]).result(timeout=60)
        s.named[step["await"]] = r
        check(s, r, expect, step["await"])
    elif "close_gate" in step:
        s.gates.execute("SELECT pg_advisory_lock(4242, %s::int)", (step["close_gate"],))
    elif "open_gate" in step:
        s.gates.execute("SELECT pg_advisory_unlock(4242, %s::int)", (step["open_gate"],))
    elif "wait_gate" in step:
        gate = step["wait_gate"]
        poll(f"gate {gate}", s, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 4242"
             " AND objid = %s AND NOT granted", (gate["gate"],), gate["waiters"])
    elif "wait_begin" in step:
        poll("waiters in idem_begin", s,
             "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'active'"
             " AND query LIKE '%%idem_begin%%' AND wait_event_type IN ('Lock', 'Extension')"
             " AND pid <> pg_backend_pid()", (), step["wait_begin"]["waiters"])
    elif "terminate_claims" in step:
        s.db.execute("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                     " WHERE datname = current_database() AND application_name = 'conformance-claims'")
    elif "sql_session" in step:
        with s.connect("conformance-sql") as conn:
            for statement in step["sql_session"]:
                conn.execute(statement)
    elif "restart_server" in step:
        assert s.own is not None, "restart_server is a step of the process cases"
        s.own.restart()
        s.db.close()
        s.gates.close()
        s.db, s.gates = s.connect("conformance-runner"), s.connect("conformance-gates")
    elif "kill_app" in step:
        assert s.app is not None, "kill_app is a step of the process cases"
        s.app.kill()
        s.app.wait(DEADLINE_S)
        s.app, s.base = start_app(s)
    else:
        pytest.fail(f"a step this runner does not know: {step}")


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_case(served: Served, case: dict[str, Any]) -> None:
    with ThreadPoolExecutor(max_workers=16) as pool:
        for step in case["steps"]:
            run_step(served, step, pool)
        assert not served.started, f"started and never awaited: {list(served.started)}"
    for key, kinds in case.get("runs", {}).items():
        for kind in ("handler", "recover"):
            row = served.db.execute("SELECT count(*) FROM conformance_runs WHERE key = %s AND kind = %s",
                                    (key, kind)).fetchone()
            assert row is not None and row[0] == kinds.get(kind, 0), f"runs of {key!r} ({kind})"


# ---------------------------------------------------------- the process cases

def start_app(s: Served) -> tuple[subprocess.Popen[bytes], str]:
    """This file's app in a process of its own (uvicorn, as ``__main__``
    below runs it), for the database of ``s`` on its own server."""
    assert s.own is not None
    host = psycopg.conninfo.conninfo_to_dict(s.own.conninfo)["host"]
    env = dict(os.environ, PGHOST=str(host), PGPORT="5432", PGDATABASE=s.dbname)
    proc = subprocess.Popen([sys.executable, __file__, s.dbname], env=env, stdout=subprocess.PIPE,
                            cwd=os.path.dirname(__file__))
    assert proc.stdout is not None
    port = proc.stdout.readline().decode().strip()
    assert port, f"the app did not start (exit status {proc.wait(DEADLINE_S)})"
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60      # importing FastAPI on a loaded machine takes a while
    while True:
        try:
            httpx.get(base + "/", timeout=5)
            return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the app did not start (exit status {proc.poll()})")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def own_served() -> Iterator[Served]:
    """A server of the runner's own (it is restarted) with the app's schema
    in a database of its own; the app is started by each case."""
    with own_server_running() as own:
        with psycopg.connect(own.conninfo, autocommit=True) as admin:
            admin.execute("CREATE DATABASE conformance")
        install_edition(psycopg.conninfo.make_conninfo(own.conninfo, dbname="conformance"))

        def connect(application: str) -> psycopg.Connection[Any]:
            return psycopg.connect(psycopg.conninfo.make_conninfo(own.conninfo, dbname="conformance",
                                                                  application_name=application), autocommit=True)
        served = Served("", connect("conformance-runner"), connect("conformance-gates"), "conformance", own=own)
        for statement in filter(is_schema_statement, CASES["app"]["schema"]):
            served.db.execute(statement)
        try:
            yield served
        finally:
            served.db.close()
            served.gates.close()


@pytest.mark.parametrize("case", CASES["process_cases"], ids=[c["name"] for c in CASES["process_cases"]])
def test_process_case(own_served: Served, case: dict[str, Any]) -> None:
    s = own_served
    s.app, s.base = start_app(s)
    try:
        test_case(s, case)
    finally:
        s.app.terminate()
        s.app.wait(DEADLINE_S)
        s.app = None


if __name__ == "__main__":
    # the app of the process cases: serve make_app(argv[1]) on 127.0.0.1 and
    # print the port (the libpq environment names the server)
    import socket

    import uvicorn  # type: ignore[import]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(make_app(sys.argv[1]), log_level="warning", lifespan="on")).run(sockets=[sock])
