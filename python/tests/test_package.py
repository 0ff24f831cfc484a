"""The distribution builds with its standard backend (setuptools), offline
as README says (pip, no build isolation, no index), into a wheel that has
the package, its py.typed marker and the extras."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import idempotency_pg

PYTHON_DIR = Path(__file__).resolve().parents[1]


def test_wheel_builds_offline(tmp_path: Path) -> None:
    # a copy: setuptools writes build/ and *.egg-info beside pyproject.toml
    src = tmp_path / "src"
    shutil.copytree(PYTHON_DIR, src, ignore=shutil.ignore_patterns("tests", "__pycache__", "build",
                                                                   "*.egg-info"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                          "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    wheel, = (tmp_path / "dist").glob("idempotency_pg-*.whl")
    assert wheel.name.startswith(f"idempotency_pg-{idempotency_pg.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "idempotency_pg/py.typed" in names and "idempotency_pg/fastapi.py" in names
    assert "Provides-Extra: fastapi" in metadata
    # setuptools 66 writes "fastapi (>=0.92) ; extra == 'fastapi'", later ones
    # 'fastapi>=0.92; extra == "fastapi"'
    assert any(line.startswith("Requires-Dist: fastapi") and
               re.search(r"extra == ['\"]fastapi['\"]", line)
               for line in metadata.splitlines()), metadata
