"""A PEP 517 build backend that needs nothing but the standard library, so that
``pip install ./python`` works offline (setuptools would have to be fetched
into pip's isolated build environment).  It builds a pure-Python wheel of the
idempotency_pg directory from pyproject.toml's [project] table, and an sdist.
Python 3.11 or later (tomllib)."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "idempotency_pg"


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _metadata() -> str:
    p = _project()
    lines = ["Metadata-Version: 2.1", f"Name: {p['name']}", f"Version: {p['version']}",
             f"Summary: {p['description']}", f"License: {p['license']['text']}",
             f"Requires-Python: {p['requires-python']}"]
    lines += [f"Requires-Dist: {d}" for d in p.get("dependencies", [])]
    for extra, deps in p.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    return "\n".join(lines) + "\n\n" + (ROOT / "README.md").read_text()


def _dist_name() -> str:
    p = _project()
    return f"{p['name'].replace('-', '_')}-{p['version']}"


def _files() -> list[Path]:
    return sorted(f for f in (ROOT / PACKAGE).rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    """Write the wheel into ``wheel_directory``; return its file name."""
    name = _dist_name()
    info = f"{name}.dist-info"
    entries: list[tuple[str, bytes]] = [(f.relative_to(ROOT).as_posix(), f.read_bytes()) for f in _files()]
    entries.append((f"{info}/METADATA", _metadata().encode()))
    entries.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: idempotency_pg _build\n"
                                     b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    record = "".join(f"{path},{_hash(data)},{len(data)}\n" for path, data in entries) + f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    wheel = f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in entries:
            z.writestr(path, data)
    return wheel


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    """Write the source archive into ``sdist_directory``; return its file name."""
    name = _dist_name()
    members = [ROOT / "pyproject.toml", ROOT / "README.md", ROOT / "_build" / "backend.py", *_files()]
    with tarfile.open(Path(sdist_directory) / f"{name}.tar.gz", "w:gz") as tar:
        for f in members:
            tar.add(f, arcname=f"{name}/{f.relative_to(ROOT).as_posix()}")
        pkg_info = _metadata().encode()
        ti = tarfile.TarInfo(f"{name}/PKG-INFO")
        ti.size = len(pkg_info)
        tar.addfile(ti, io.BytesIO(pkg_info))
    return f"{name}.tar.gz"
