"""Fixtures for the idempotency_pg tests.

The server is the one the libpq environment names (PGHOST, PGPORT, PGUSER,
PGDATABASE): a database where ``CREATE EXTENSION idempotency`` has been run,
as test/python/run prepares.  Only the tests that restart a server start
one of their own (:func:`own_server`, with the binaries in ``PG_BINDIR``,
which test/run exports): the shared one serves other suites meanwhile.  The
async tests run their coroutines with asyncio.run (no pytest plugin needed).

Against the portable edition (test/portable/run), ``IDEM_TEST_INSTALL`` is
the command that installs it in a database instead of ``CREATE EXTENSION
idempotency`` (test/portable/install pgtle, or schema), and
``IDEM_TEST_SERVER_OPTIONS`` the options a server of the tests' own starts
with (``-c shared_preload_libraries=pg_tle``): :func:`install_edition`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

T = TypeVar("T")

#: how long a test waits for a condition before it fails (a bound for a
#: loaded machine, never a verdict on speed)
DEADLINE_S = 60.0


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end in a new event loop."""
    return asyncio.run(coro)


def new_key(label: str) -> str:
    return f"{label}-{uuid.uuid4()}"


#: the command that installs the edition in a database (None: CREATE EXTENSION idempotency)
INSTALL = os.environ.get("IDEM_TEST_INSTALL") or None
#: the portable edition, installed with psql into schema idempotency (no pg_extension row)?
SCHEMA_INSTALL = (INSTALL or "").endswith(" schema")


def install_edition(conninfo: str) -> None:
    """Install the edition under test in the database ``conninfo`` names:
    ``CREATE EXTENSION idempotency``, or the command ``IDEM_TEST_INSTALL``
    with the libpq environment naming that database."""
    if INSTALL is None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION idempotency")
        return
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    env = dict(os.environ)
    for name, var in (("host", "PGHOST"), ("port", "PGPORT"), ("dbname", "PGDATABASE"), ("user", "PGUSER")):
        if params.get(name) is not None:
            env[var] = str(params[name])
    subprocess.run(shlex.split(INSTALL), env=env, check=True, stdout=subprocess.DEVNULL)


def is_schema_statement(statement: str) -> bool:
    """Is it one of cases.json's "schema" statements other than CREATE
    EXTENSION idempotency (which :func:`install_edition` does)?"""
    return not statement.upper().startswith("CREATE EXTENSION")


@pytest.fixture(scope="session")
def admin() -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for looking at the server from outside."""
    with psycopg.connect("", autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname = 'idem_begin'"
                            " AND pg_function_is_visible(oid)").fetchone() != (0,), \
            "the test database lacks the idempotency extension"
        yield conn


@pytest.fixture(scope="session")
def portable(admin: psycopg.Connection[Any]) -> bool:
    """Is the server's edition the portable one (SQL and PL/pgSQL)?"""
    row = admin.execute("SELECT to_regprocedure('idem_portable_version()') IS NOT NULL").fetchone()
    return bool(row and row[0])


def expire_completed(admin: psycopg.Connection[Any], key: str) -> None:
    """Move the key's completed record past its ttl, as test/demo does, in
    the tables that the edition keeps records in: the C edition's
    idem_result and idem_record (which one depends on its durability mode),
    the portable edition's one idem_record (docs/managed-postgresql.md,
    "durability")."""
    for table in ("idem_result", "idem_record"):
        row = admin.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
        if row and row[0]:
            admin.execute(sql.SQL("UPDATE {} SET expires_at = now() - interval '1 s'"
                                  " WHERE key = %s AND completed_at IS NOT NULL").format(sql.Identifier(table)),
                          (key,))


@pytest.fixture(scope="session")
def has_1_4(admin: psycopg.Connection[Any]) -> bool:
    """Does the server's extension have the 1.4 API (idem_checkpoint)?"""
    row = admin.execute(
        "SELECT to_regprocedure('idem_checkpoint(text,text,bigint,jsonb)') IS NOT NULL").fetchone()
    return bool(row and row[0])


@pytest.fixture
def needs_1_4(has_1_4: bool) -> None:
    if not has_1_4:
        pytest.skip("the server's extension has no idem_checkpoint (version 1.4 API)")


def waiting_claims(admin: psycopg.Connection[Any]) -> int:
    """How many backends of this database wait inside idem_begin: on the
    latch a finish sets, or on the lock of an uncommitted claim."""
    row = admin.execute(
        """SELECT count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND pid <> pg_backend_pid()
              AND state = 'active' AND query LIKE '%%idem_begin%%'
              AND wait_event_type IN ('Extension', 'Lock')""").fetchone()
    assert row is not None
    return int(row[0])


def wait_for(what: str, condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        time.sleep(0.005)


async def await_for(what: str, condition: Callable[[], bool]) -> None:
    """:func:`wait_for` for a coroutine: the event loop keeps running."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.005)


def record_state(admin: psycopg.Connection[Any], operation: str, key: str) -> str | None:
    """idem_inspect's state of the key's record (None: no record)."""
    row = admin.execute("SELECT state FROM idem_inspect(%s::text, %s::text)", (operation, key)).fetchone()
    return str(row[0]) if row else None


@dataclass
class Server:
    """A PostgreSQL server of the test's own, with the extension created in
    its ``postgres`` database: ``conninfo`` reaches it; ``restart()``
    stops it (fast: every session ends) and starts it again."""

    bindir: str
    datadir: str
    conninfo: str

    def ctl(self, *args: str) -> None:
        subprocess.run([os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-w", *args],
                       check=True, stdout=subprocess.DEVNULL)

    def restart(self) -> None:
        self.ctl("-m", "fast", "restart")


@pytest.fixture
def own_server() -> Iterator[Server]:
    """A throwaway server for a test that restarts it (:func:`own_server_running`)."""
    with own_server_running() as server:
        yield server


@contextlib.contextmanager
def own_server_running() -> Iterator[Server]:
    """A throwaway server (initdb in a temporary directory, a Unix socket
    there, no TCP) for a test that restarts it; ``PG_BINDIR`` names the
    binaries of the installation that has the extension."""
    bindir = os.environ.get("PG_BINDIR")
    assert bindir, "PG_BINDIR must name the PostgreSQL binaries (test/run exports it)"
    tmp = tempfile.mkdtemp(prefix="idem-python-")
    datadir = os.path.join(tmp, "data")
    subprocess.run([os.path.join(bindir, "initdb"), "-D", datadir, "-A", "trust", "--no-sync"],
                   check=True, stdout=subprocess.DEVNULL)
    conninfo = f"host={tmp} port=5432 dbname=postgres"
    server = Server(bindir, datadir, conninfo)
    options = os.environ.get("IDEM_TEST_SERVER_OPTIONS", "")
    server.ctl("-l", os.path.join(tmp, "log"), "-o", f"-k {tmp} -c listen_addresses= -p 5432 {options}", "start")
    try:
        install_edition(conninfo)
        yield server
    finally:
        try:
            server.ctl("-m", "immediate", "stop")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a port of its own), in a
    thread with its own event loop (its startup and shutdown handlers run
    there); yields the base URL."""
    import uvicorn  # type: ignore[import]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for("uvicorn starts", lambda: server.started or not thread.is_alive())
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
