"""HTTP without a framework: the ``Idempotency-Key`` request header and the
README's SQLSTATE -> HTTP table ("Errors and HTTP") as RFC 9457 problem
details.  :mod:`idempotency_pg.fastapi` uses it; another framework can too.

The header follows draft-ietf-httpapi-idempotency-key-header: an RFC 8941
String (``"8e03978e-40d5-43e8-bc93-6894a57f9324"``), or, as older clients
send it, one bare run of visible ASCII without quote, backslash, comma or
semicolon; 1 to 255 characters (the extension's limit on a key).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from . import _core
from .errors import (ExtensionVersionError, IdempotencyError, InProgressError, InvalidRequestError,
                     KeyReuseError, ResponseExpiredError)

MAX_KEY_LENGTH = 255
_BARE = re.compile(r"[!#-+\--:<-\[\]-~]+")

#: the problem types this module answers with: slug -> title
TITLES: dict[str, str] = {
    "idempotency-key-missing": "Idempotency-Key is missing",
    "idempotency-key-malformed": "Idempotency-Key is malformed",
    "idempotency-key-reused": "Idempotency-Key is already used",
    "idempotency-key-expired": "Idempotency-Key has expired",
    "request-in-progress": "A request is outstanding for this Idempotency-Key",
    "invalid-request": "Invalid request",
    "internal-error": "Internal error",
    "service-unavailable": "Service unavailable",
}


@dataclass(frozen=True)
class ParsedKey:
    """``key`` when the header is valid; else ``missing`` and ``reason``."""

    key: str | None = None
    missing: bool = False
    reason: str = ""


def parse_idempotency_key(values: list[str], max_length: int = MAX_KEY_LENGTH) -> ParsedKey:
    """Parse the header's values (a header sent twice is malformed)."""
    if not values:
        return ParsedKey(missing=True, reason="The Idempotency-Key header is missing.")
    value = ", ".join(values).strip(" ")
    if value.startswith('"'):
        key = _parse_sf_string(value)
        if key is None:
            return ParsedKey(reason="The Idempotency-Key header is not a valid Structured Field String "
                                    "(printable ASCII inside double quotes, \\\" and \\\\ as the only "
                                    "escapes, nothing after the closing quote).")
    elif _BARE.fullmatch(value):
        key = value
    elif value == "":
        return ParsedKey(missing=True, reason="The Idempotency-Key header is empty.")
    else:
        return ParsedKey(reason="The Idempotency-Key header must be a quoted string, e.g. "
                                'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324".')
    if key == "":
        return ParsedKey(reason="The Idempotency-Key must not be empty.")
    if len(key) > max_length:
        return ParsedKey(reason=f"The Idempotency-Key has {len(key)} characters; "
                                f"at most {max_length} are allowed.")
    return ParsedKey(key=key)


def _parse_sf_string(text: str) -> str | None:
    """RFC 8941 4.2.5, the whole input being that one string."""
    out = []
    i = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 1
            if i >= len(text) or text[i] not in '"\\':
                return None
            out.append(text[i])
        elif c == '"':
            return "".join(out) if i == len(text) - 1 else None
        elif not " " <= c <= "~":
            return None
        else:
            out.append(c)
        i += 1
    return None


@dataclass(frozen=True)
class Problem:
    """An RFC 9457 problem: ``status``, its type's ``slug``, ``detail``,
    members to add (``extra``), response ``headers``, and a ``title``
    (default: the slug's in :data:`TITLES`)."""

    status: int
    slug: str
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    title: str | None = None

    def body(self, type_base: str | None = None) -> dict[str, Any]:
        """The problem+json object; its ``type`` is ``type_base + slug``
        (``about:blank`` without a base)."""
        return {"type": "about:blank" if type_base is None else type_base + self.slug,
                "title": self.title or TITLES.get(self.slug, self.slug), "status": self.status,
                "detail": self.detail, **self.extra}


def key_problem(parsed: ParsedKey) -> Problem:
    """400 for a missing or invalid header."""
    return Problem(400, "idempotency-key-missing" if parsed.missing else "idempotency-key-malformed",
                   parsed.reason)


def retry_after(record: _core.Record | None) -> int:
    """``Retry-After`` (whole seconds, at least 1) for a 409: what is left
    of the holding claim's lease, by the server's clock."""
    if record is None or record.state != "pending" or record.lease_remaining is None:
        return 1
    return max(1, math.ceil(record.lease_remaining.total_seconds()))


def problem_for(err: BaseException, record: _core.Record | None = None) -> Problem | None:
    """The README's SQLSTATE -> HTTP table for an error of a claim
    (``record``: the key's, for a 409's ``Retry-After``); ``None`` for an
    error the table does not name."""
    if isinstance(err, InProgressError):     # IK409, or a wait_timeout
        return Problem(409, "request-in-progress", "A request with this Idempotency-Key is still being "
                       "processed. Retry later with the same key.",
                       headers={"Retry-After": str(retry_after(record))})
    if isinstance(err, KeyReuseError):
        return Problem(422, "idempotency-key-reused", "This Idempotency-Key was already used for a "
                       "request with different parameters.",
                       extra={"stored_fingerprint": err.stored_fingerprint,
                              "request_fingerprint": err.request_fingerprint})
    if isinstance(err, ResponseExpiredError):
        return Problem(410, "idempotency-key-expired", "This Idempotency-Key was used for a request "
                       "that completed; its response is no longer kept. Use a new key for a new request.")
    if isinstance(err, InvalidRequestError):
        return Problem(400, "invalid-request", f"Invalid argument: {err}.")
    if isinstance(err, ExtensionVersionError):
        return Problem(500, "internal-error", "The server could not complete the request.")
    if isinstance(err, IdempotencyError):     # IK412, 54000, not stored, recovery needed
        return Problem(500, "internal-error", "This attempt could not complete the request for its "
                       "Idempotency-Key. Retry with the same key.")
    if _core.store_unreachable(err) or isinstance(err, PoolTimeout) or \
            (isinstance(err, psycopg.Error) and err.sqlstate in ("40001", "25006", "57014")):
        return Problem(503, "service-unavailable", "Could not claim the Idempotency-Key; retry with "
                       "the same key.", headers={"Retry-After": "1"})
    return None


def json_bytes(value: Any) -> bytes:
    """Compact JSON (as JSON.stringify writes it); an ``int`` stays exact."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
