"""Every ```python snippet of python/README.md and docs/applications.md,
checked with ``mypy --strict`` and with pyright in strict mode, as a
user's type checker sees it.  A snippet
may use the names its prose leaves to the application (``app``,
``provider``, ``ChargeIn``, ...): they come from a module ``shop`` made
here, which each snippet imports (``from shop import *``) unless it imports
from it itself; a snippet with ``await`` or ``return`` outside a function
is checked as the body of an ``async def``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg_pool
import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ["python/README.md", "docs/applications.md"]

SHOP = '''
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from idempotency_pg import AsyncCoordinator, fingerprint

__all__ = ["app", "provider", "ChargeIn", "Charge", "pool", "coordinator", "key", "customer",
           "amount", "body", "Response", "AsyncCoordinator", "fingerprint", "Any"]


@dataclass
class Charge:
    id: str
    amount: int


class ChargeIn(BaseModel):
    customer: str
    amount: int
    currency: str


class Provider:
    async def charge(self, order_id: str, amount: int, *, idempotency_key: str | None) -> dict[str, Any]:
        return {"id": "ch_1", "amount": amount}

    async def charge_model(self, order_id: str, amount: int, *, idempotency_key: str | None) -> Charge:
        return Charge("ch_1", amount)


app = FastAPI()
provider = Provider()
pool = AsyncConnectionPool("", open=False)
coordinator = AsyncCoordinator(pool)
key = "8e03978e-40d5-43e8-bc93-6894a57f9324"
customer, amount = "cus_1", 4200
body = b"{}"
'''

# prometheus_client is not among the test's packages: the part of it the README uses
PROMETHEUS = '''
from typing import Any


class Counter:
    def __init__(self, name: str, documentation: str, labelnames: list[str]) -> None: ...

    def labels(self, *values: str) -> "Counter": ...

    def inc(self, amount: float = 1) -> None: ...
'''


def snippets() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for n, m in enumerate(re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)):
            out.append((f"{doc}#{n + 1}", m.group(1)))
    return out


def as_module(code: str) -> str:
    top = [line for line in code.splitlines() if line and not line.startswith((" ", "\t"))]
    head = "from __future__ import annotations\n"
    if any(re.match(r"(return|await|async with|async for)\b", line) for line in top):
        code = "async def snippet() -> Any:\n" + textwrap.indent(code, "    ")
        head += "from typing import Any\n"
    if not re.search(r"^from shop import", code, re.M):
        head += "from shop import *  # noqa\n"
    return head + code


def write_snippets(tmp_path: Path) -> list[str]:
    """The snippets as modules in ``tmp_path``, beside ``shop`` and
    ``prometheus_client``; their file names."""
    found = snippets()
    assert len(found) >= 6, found
    (tmp_path / "shop.py").write_text(SHOP)
    (tmp_path / "prometheus_client.py").write_text(PROMETHEUS)
    files = []
    for name, code in found:
        path = tmp_path / (re.sub(r"\W", "_", name) + ".py")
        path.write_text(as_module(code))
        files.append(path.name)
    return files


def pyright(tmp_path: Path, files: list[str]) -> subprocess.CompletedProcess[str]:
    """pyright in strict mode over ``files`` of ``tmp_path``, with the
    package from the tree and this Python's modules.  test/python/run
    installs pyright (from the npm registry) and names it in $PYRIGHT."""
    exe = os.environ.get("PYRIGHT") or shutil.which("pyright")
    assert exe, "pyright is not installed: set PYRIGHT (test/python/run installs it)"
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({
        "typeCheckingMode": "strict", "extraPaths": [str(REPO / "python")]}))
    return subprocess.run([exe, "--pythonpath", sys.executable, *files],
                          cwd=tmp_path, capture_output=True, text=True)


def test_documented_snippets_pass_mypy_strict(tmp_path: Path) -> None:
    files = write_snippets(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'python'}{os.pathsep}{tmp_path}",
           "MYPYPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-warn-unused-ignores",
                          "--cache-dir=/dev/null", *files],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_documented_snippets_pass_pyright_strict(tmp_path: Path) -> None:
    # psycopg_pool 3.2 made the pools generic, and pyright 1.1.414 leaves the
    # type parameter of `AsyncConnectionPool("dbname=shop")` unsolved (an
    # error in any strict code that passes such a pool on, ours or not):
    # the snippets are checked where the pool is not generic (Debian 12)
    if tuple(int(n) for n in psycopg_pool.__version__.split(".")[:2]) >= (3, 2):
        pytest.skip(f"psycopg_pool {psycopg_pool.__version__}: pyright cannot type its pool's constructor")
    run = pyright(tmp_path, write_snippets(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr


# a call against a decorated method's signature, two wrong ones on lines 23 and 24
WRONG = textwrap.dedent('''
        from idempotency_pg import AsyncCoordinator, Coordinator, idempotent

        class Payments:
            def __init__(self, coordinator: AsyncCoordinator) -> None:
                self.coordinator = coordinator

            @idempotent("payment.charge", coordinator="self.coordinator")
            async def charge(self, order_id: str, *, idempotency_key: str | None) -> int:
                return 1

        class SyncPayments:
            def __init__(self, coordinator: Coordinator) -> None:
                self.coordinator = coordinator

            @idempotent("payment.charge", coordinator="self.coordinator")
            def charge(self, order_id: str, *, idempotency_key: str | None) -> int:
                return 1

        async def use(p: Payments, s: SyncPayments) -> None:
            _a: int = await p.charge("o", idempotency_key=None)
            _b: int = s.charge("o", idempotency_key=None)
            await p.charge(42, idempotency_key=None)
            s.charge("o", key=None)
''')


def test_mypy_sees_the_signatures(tmp_path: Path) -> None:
    """The check above can fail: a call against a decorated method's
    signature is an error for mypy."""
    (tmp_path / "shop.py").write_text(SHOP)
    (tmp_path / "wrong.py").write_text(WRONG)
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    run = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir=/dev/null", "wrong.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [23, 24], run.stdout


def test_pyright_sees_the_signatures(tmp_path: Path) -> None:
    """The pyright check can fail too: the same two wrong calls."""
    (tmp_path / "wrong.py").write_text(WRONG)
    run = pyright(tmp_path, ["wrong.py"])
    errors = [line for line in run.stdout.splitlines() if " - error: " in line]
    assert sorted({int(line.split(":")[1]) for line in errors}) == [23, 24], run.stdout
