"""HTTP without a framework: the ``Idempotency-Key`` request header and the
table of docs/http.md ("The HTTP contract of the packages") as RFC 9457
problem details.  :mod:`idempotency_pg.fastapi` uses it; another framework
can too.

The header follows draft-ietf-httpapi-idempotency-key-header: an RFC 8941
String (``"8e03978e-40d5-43e8-bc93-6894a57f9324"``), or, as older clients
send it, one bare run of visible ASCII without quote, backslash, comma or
semicolon; 1 to 255 characters (the extension's limit on a key).
"""

# The package's modules share _core and each other's underscored members by
# design (one package, one author): pyright's private-usage rule is for
# other people's privates.
# pyright: reportPrivateUsage=false
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from . import _core
from .errors import (IdempotencyError, InProgressError, InvalidRequestError, KeyReuseError, LostClaimError,
                     ResponseExpiredError, ResponseNotStoredError)

MAX_KEY_LENGTH = 255
#: the media type of every refusal (RFC 9457)
PROBLEM_MEDIA_TYPE = "application/problem+json"
#: what a problem's ``type`` starts with unless a route names another base
DEFAULT_TYPE_BASE = "urn:idempotency:problem:"
_BARE = re.compile(r"[!#-+\--:<-\[\]-~]+")

#: the problem types this module answers with: slug -> title
TITLES: dict[str, str] = {
    "idempotency-key-missing": "Idempotency-Key is missing",
    "idempotency-key-malformed": "Idempotency-Key is malformed",
    "idempotency-key-reused": "Idempotency-Key is already used",
    "idempotency-key-expired": "The response for this Idempotency-Key has expired",
    "request-in-progress": "A request is outstanding for this Idempotency-Key",
    "response-not-stored": "The response for this Idempotency-Key was not stored",
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
        return ParsedKey(reason="The Idempotency-Key header must be a quoted string "
                                '(Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324") or one '
                                'run of visible ASCII without quote, backslash, comma or semicolon.')
    if key == "":
        return ParsedKey(reason="The Idempotency-Key must not be empty.")
    if len(key) > max_length:
        return ParsedKey(reason=f"The Idempotency-Key has {len(key)} characters; "
                                f"at most {max_length} are allowed.")
    return ParsedKey(key=key)


def _parse_sf_string(text: str) -> str | None:
    """RFC 8941 4.2.5, the whole input being that one string."""
    out: list[str] = []
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
    extra: dict[str, Any] = field(default_factory=dict[str, Any])
    headers: dict[str, str] = field(default_factory=dict[str, str])
    title: str | None = None

    def body(self, type_base: str | None = None) -> dict[str, Any]:
        """The problem+json object; its ``type`` is ``type_base + slug``
        (:data:`DEFAULT_TYPE_BASE` without a base)."""
        return {"type": (DEFAULT_TYPE_BASE if type_base is None else type_base) + self.slug,
                "title": self.title or TITLES.get(self.slug, self.slug), "status": self.status,
                "detail": self.detail, **self.extra}


def key_problem(parsed: ParsedKey) -> Problem:
    """400 for a missing or invalid header."""
    return Problem(400, "idempotency-key-missing" if parsed.missing else "idempotency-key-malformed",
                   parsed.reason)


def retry_after(record: _core.Record | None, mean: float | None) -> int:
    """``Retry-After`` (whole seconds, at least 1) for a 409: an estimate of
    when the holding attempt ends -- ``mean`` (the operation's mean attempt
    duration, in seconds, ``None`` if none was measured) minus the record's
    ``age``, never past what is left of its lease."""
    if mean is None or record is None or record.age is None:
        return 1
    left = mean - record.age.total_seconds()
    if record.lease_remaining is not None:
        left = min(left, record.lease_remaining.total_seconds())
    return max(1, math.ceil(left))


def problem_for(err: BaseException, retry_after_s: int = 1) -> Problem | None:
    """docs/http.md's table for an error of a claim (``retry_after_s``: a
    409's ``Retry-After``, see :func:`retry_after`); ``None`` for an error
    the table does not name."""
    if isinstance(err, InProgressError):     # IK409, or a wait_timeout
        return Problem(409, "request-in-progress", "A request with this Idempotency-Key is still being "
                       "processed. Retry later with the same key.",
                       headers={"Retry-After": str(retry_after_s)})
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
    if isinstance(err, LostClaimError):
        return not_stored_problem(500)
    if isinstance(err, ResponseNotStoredError):   # the decorator's: it ran, its result is not stored
        return not_stored_problem(410) if err.completed else not_stored_problem(500, later=err.storing)
    if isinstance(err, IdempotencyError):     # the version, 54000 or IK412 elsewhere
        return Problem(500, "internal-error", "The server could not complete the request.")
    if _core.store_unreachable(err) or isinstance(err, PoolTimeout) or \
            (isinstance(err, psycopg.Error) and err.sqlstate in ("40001", "25006", "57014")):
        return Problem(503, "service-unavailable", "Could not claim the Idempotency-Key; retry with "
                       "the same key.", headers={"Retry-After": "1"})
    return None


def not_stored_problem(status: int, *, later: bool = False) -> Problem:
    """``response-not-stored``: 410 for a key whose request ran (or may have)
    and whose response is not kept, which is what every retry gets; 500 for
    the attempt that could not send or store it, or (``later``) whose
    response is stored in the background once the database takes it."""
    if status == 410:
        detail = ("A request with this Idempotency-Key was processed, but its response was not "
                  "stored. It will not run again: look up its result, or use a new key for a new request.")
    elif later:
        detail = ("This request was processed, but its response is not stored yet. It will not run "
                  "again; a retry with the same key gets its response.")
    else:
        detail = ("This request was processed, but its response could not be sent or stored. It "
                  "will not run again; a retry with the same key gets 410.")
    return Problem(status, "response-not-stored", detail)


def json_bytes(value: Any) -> bytes:
    """Compact JSON (as JSON.stringify writes it); an ``int`` stays exact."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
