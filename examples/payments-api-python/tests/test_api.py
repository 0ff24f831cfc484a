"""End-to-end test of the FastAPI payments example: real uvicorn processes,
real concurrent HTTP, against the server the libpq environment names (a
database with the idempotency extension: test/python/run makes one).  The
same scenarios as examples/payments-api/test/api.test.js."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

APP_DIR = Path(__file__).resolve().parent.parent
SCHEMA = APP_DIR.parent / "payments-api" / "schema.sql"
PROVIDER_DELAY_MS = 300
# how long a test waits for a condition (the API starting, a claim) before
# it fails: a bound for a loaded machine, never a verdict on speed
DEADLINE_S = 60.0


def new_key(label: str) -> str:
    return f"{label}-{uuid.uuid4()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def db() -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect("", autocommit=True) as conn:
        conn.execute(SCHEMA.read_text())
        yield conn


def start_api(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "app:from_env", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=APP_DIR, env={**os.environ, "PROVIDER_DELAY_MS": str(PROVIDER_DELAY_MS),
                          "PROVIDER_FLAKY_CUSTOMERS": "cus_flaky", **env})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + DEADLINE_S
    while True:  # until it answers
        try:
            if httpx.get(f"{base}/problems/request-in-progress").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the API did not start (exit status {proc.poll()})")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def apis(db: psycopg.Connection[Any]) -> Iterator[dict[str, str]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bases = {}
        for mode in ("wait", "raise"):
            proc, bases[mode] = start_api({"IN_FLIGHT": mode})
            procs.append(proc)
        yield bases
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


async def post(client: httpx.AsyncClient, base: str, key: str | None, body: Any,
               raw_key: str | None = None, timeout: float = 15.0) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["idempotency-key"] = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    elif raw_key is not None:
        headers["idempotency-key"] = raw_key
    return await client.post(f"{base}/charges", json=body, headers=headers, timeout=timeout)


def charges_for(db: psycopg.Connection[Any], key: str) -> int:
    """Calls the provider got with this key: each one would have been a charge
    at a provider that does not deduplicate."""
    row = db.execute("SELECT coalesce(sum(calls), 0) FROM provider_charges"
                     " WHERE provider_key = %s::text", (key,)).fetchone()
    return int(row[0]) if row else 0


def claim_state(db: psycopg.Connection[Any], key: str) -> Any:
    row = db.execute("SELECT state FROM idem_inspect('payment.charge', %s::text)", (key,)).fetchone()
    return row[0] if row else None


async def until_pending(db: psycopg.Connection[Any], key: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while claim_state(db, key) != "pending":
        assert time.monotonic() < deadline, "the first attempt never held the key"
        await asyncio.sleep(0.005)


def assert_charge(r: httpx.Response, body: dict[str, Any]) -> None:
    assert r.status_code == 201, r.text
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    j = r.json()
    assert r.headers["location"] == f"/charges/{j['id']}"
    assert {k: j[k] for k in ("customer", "amount", "currency")} == \
        {k: body[k] for k in ("customer", "amount", "currency")}


def assert_same(a: httpx.Response, b: httpx.Response) -> None:
    assert (a.status_code, a.content, a.headers["location"]) == (b.status_code, b.content, b.headers["location"])


def assert_problem(r: httpx.Response, status: int, type_: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == f"/problems/{type_}" and r.json()["status"] == status


def test_client_gives_up_after_50ms_and_retries(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    """The seed scenario: one charge, and the retry gets the first attempt's response."""
    key, body = new_key("timeout-retry"), {"customer": "cus_alice", "amount": 1000, "currency": "EUR"}

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            with pytest.raises(httpx.TimeoutException):
                await post(client, apis["wait"], key, body, timeout=0.05)
            await until_pending(db, key)
            retry = await post(client, apis["wait"], key, body)
            assert_charge(retry, body)
            assert retry.headers["idempotent-replayed"] == "true"
            assert time.monotonic() - t0 >= (PROVIDER_DELAY_MS - 20) / 1000, "the retry waited for the charge"
            third = await post(client, apis["wait"], key, body)
            assert_same(third, retry)
            got = await client.get(apis["wait"] + retry.headers["location"])
            assert got.json() == retry.json()
    asyncio.run(main())
    assert charges_for(db, key) == 1


def test_12_simultaneous_duplicates(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    key, body = new_key("burst"), {"customer": "cus_bob", "amount": 2500, "currency": "USD"}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=20)) as client:
            return list(await asyncio.gather(*(post(client, apis["wait"], key, body) for _ in range(12))))
    responses = asyncio.run(main())
    for r in responses:
        assert_charge(r, body)
        assert_same(r, responses[0])
    assert sum(r.headers.get("idempotent-replayed") != "true" for r in responses) == 1
    assert charges_for(db, key) == 1


def test_raise_gives_409_while_running(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    key, body = new_key("raise"), {"customer": "cus_carol", "amount": 700, "currency": "GBP"}

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            first = asyncio.ensure_future(post(client, apis["raise"], key, body))
            await until_pending(db, key)
            dup = await post(client, apis["raise"], key, body)
            assert_problem(dup, 409, "request-in-progress")
            # an estimate of when the first attempt ends (the provider takes 300 ms), in
            # whole seconds, not what is left of its 30 s lease (docs/http.md)
            assert 1 <= int(dup.headers["retry-after"]) <= 10, dup.headers["retry-after"]
            original = await first
            assert_charge(original, body)
            assert_same(await post(client, apis["raise"], key, body), original)
    asyncio.run(main())
    assert charges_for(db, key) == 1


def test_key_reused_with_another_amount(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    key, body = new_key("reuse"), {"customer": "cus_dave", "amount": 1000, "currency": "EUR"}

    def server_fp(amount: int) -> str:
        row = db.execute("SELECT encode(idem_fingerprint(%s::text, %s::bigint, %s::text), 'hex')",
                         ("cus_dave", amount, "EUR")).fetchone()
        assert row is not None
        return str(row[0])

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            first = await post(client, apis["wait"], key, body)
            assert_charge(first, body)
            reuse = await post(client, apis["wait"], key, {**body, "amount": 5})
            assert_problem(reuse, 422, "idempotency-key-reused")
            assert reuse.json()["stored_fingerprint"] == server_fp(1000)
            assert reuse.json()["request_fingerprint"] == server_fp(5)
            assert_same(await post(client, apis["wait"], key, body), first)
    asyncio.run(main())
    assert charges_for(db, key) == 1


def test_bad_keys_and_bodies_are_400(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    body = {"customer": "cus_bad_key", "amount": 100, "currency": "EUR"}

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            assert_problem(await post(client, apis["wait"], None, body), 400, "idempotency-key-missing")
            for raw in ('"' + "k" * 256 + '"', '""', '"abc', '"abc" x', '"a", "b"', '"a\\nb"', "a b"):
                assert_problem(await post(client, apis["wait"], None, body, raw_key=raw),
                               400, "idempotency-key-malformed")
            key = new_key("invalid-body")
            assert_problem(await post(client, apis["wait"], key, {**body, "amount": -5}), 400, "invalid-request")
            ok = await post(client, apis["wait"], key, body)
            assert_charge(ok, body)
            assert "idempotent-replayed" not in ok.headers, "an invalid body does not use up the key"
            assert_problem(await client.get(apis["wait"] + "/nope"), 404, "not-found")
    asyncio.run(main())
    row = db.execute("SELECT count(*) FROM charges WHERE customer = 'cus_bad_key'").fetchone()
    assert row == (1,)


def test_provider_failure_then_retry(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    key, body = new_key("flaky"), {"customer": "cus_flaky", "amount": 4200, "currency": "EUR"}

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            assert_problem(await post(client, apis["wait"], key, body), 502, "provider-unavailable")
            assert charges_for(db, key) == 0
            retry = await post(client, apis["wait"], key, body)
            assert_charge(retry, body)
            assert "idempotent-replayed" not in retry.headers
            assert_same(await post(client, apis["wait"], key, body), retry)
    asyncio.run(main())
    assert charges_for(db, key) == 1


def test_one_charge_per_key_in_total(db: psycopg.Connection[Any], apis: dict[str, str]) -> None:
    """After the tests above (run in file order): every key charged once, no claim left pending."""
    row = db.execute("SELECT count(*), count(DISTINCT provider_key), sum(calls) FROM provider_charges").fetchone()
    assert row == (6, 6, 6)
    row = db.execute("SELECT count(*), count(DISTINCT idempotency_key) FROM charges").fetchone()
    assert row == (6, 6)
    stats = db.execute("SELECT pending::int, lapsed::int, completed::int FROM idem_stats"
                       " WHERE operation = 'payment.charge'").fetchall()
    assert stats == [(0, 0, 6)]


def test_killed_mid_charge_then_restarted(db: psycopg.Connection[Any]) -> None:
    """The service is killed (SIGKILL) while the provider charges, and
    restarted: the retry gets 201 with the original charge, and the provider
    was called once (1.4: the claim lapses with the killed process's sessions,
    the retry gets 'recover' and asks the provider; 1.3: the retry waits for
    the 2 s lease and calls the provider again with the same key)."""
    row = db.execute("SELECT to_regprocedure('idem_checkpoint(text,text,bigint,jsonb)') IS NOT NULL").fetchone()
    recovery = bool(row and row[0])
    key, body = new_key("killed"), {"customer": "cus_kim", "amount": 800, "currency": "EUR"}
    env = {"IN_FLIGHT": "wait", "LEASE_S": "2"}
    procs: list[subprocess.Popen[bytes]] = []

    async def main() -> httpx.Response:
        proc, base = start_api(env)
        procs.append(proc)
        async with httpx.AsyncClient() as client:
            lost = asyncio.ensure_future(post(client, base, key, body))
            deadline = time.monotonic() + DEADLINE_S
            # the provider has the call (and has charged) and the claim is committed
            while charges_for(db, key) == 0:
                assert time.monotonic() < deadline, "the provider was never called"
                await asyncio.sleep(0.005)
            assert claim_state(db, key) == "pending"
            proc.kill()
            proc.wait(10)
            with pytest.raises(httpx.TransportError):
                await lost
            restarted, base = start_api(env)
            procs.append(restarted)
            t0 = time.monotonic()
            retry = await post(client, base, key, body)
            elapsed = time.monotonic() - t0
        assert_charge(retry, body)
        assert "idempotent-replayed" not in retry.headers
        if recovery:
            assert elapsed < 2.0, f"the retry was answered {elapsed:.2f} s after the restart, not at once"
        else:
            assert elapsed < 5.0, "the retry was answered once the 2 s lease had lapsed"
        return retry

    try:
        retry = asyncio.run(main())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    assert charges_for(db, key) == (1 if recovery else 2)
    rows = db.execute("SELECT id FROM charges WHERE idempotency_key = %s::text", (key,)).fetchall()
    assert rows == [(retry.json()["id"],)], "one charge, the one the retry answered with"
