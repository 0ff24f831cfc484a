"""Error responses: RFC 9457 problem details (application/problem+json).  The
mapping of the Idempotency-Key's refusals to HTTP (docs/errors.md, "Errors and HTTP")
is idempotency_pg.fastapi's; this module adds the API's own problems (the
provider, 404) and the text of every type, served at /problems/<slug>.  The
same types and titles as examples/payments-api/problems.js, plus IK410
(extension 1.4)."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from idempotency_pg.fastapi import problem_response
from idempotency_pg.http import Problem

PROBLEM_TYPES: dict[str, dict[str, str]] = {
    "idempotency-key-missing": {
        "title": "Idempotency-Key is missing",
        "doc": "POST /charges requires an Idempotency-Key header: a unique string of 1 to 255 printable "
               "ASCII characters, sent as a quoted string, e.g. "
               'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324". '
               "Send the same key when you retry the same request."},
    "idempotency-key-malformed": {
        "title": "Idempotency-Key is malformed",
        "doc": "The Idempotency-Key header must be one quoted string (RFC 8941 String) of 1 to 255 "
               "printable ASCII characters, or the same characters unquoted without spaces, quotes, "
               "backslashes, commas or semicolons."},
    "idempotency-key-reused": {
        "title": "Idempotency-Key is already used",
        "doc": "This operation is idempotent and it requires correct usage of Idempotency Key. "
               "Idempotency Key MUST not be reused across different payloads of this operation. "
               "The request fingerprint covers customer, amount and currency."},
    "idempotency-key-expired": {
        "title": "The response for this Idempotency-Key has expired",
        "doc": "A request with this Idempotency-Key was completed, and its response is no longer kept. "
               "It will not run again: use a new key for a new request."},
    "request-in-progress": {
        "title": "A request is outstanding for this Idempotency-Key",
        "doc": "A request with the same Idempotency-Key for the same operation is being processed or "
               "is outstanding. Retry later with the same key to get its response."},
    "invalid-request": {
        "title": "Invalid request",
        "doc": 'POST /charges takes a JSON object {"customer": string, "amount": positive integer in '
               'minor units, "currency": ISO 4217 code}.'},
    "provider-unavailable": {
        "title": "Payment provider unavailable",
        "doc": "The payment provider did not confirm the charge. Nothing was stored for the "
               "Idempotency-Key: retry with the same key."},
    "not-found": {"title": "Not found", "doc": "No such resource."},
    "internal-error": {"title": "Internal error", "doc": "The server could not complete the request."},
    "service-unavailable": {
        "title": "Service unavailable",
        "doc": "The server cannot handle the request right now; retry it with the same Idempotency-Key."},
}

#: the problem types' base: the API serves each type's text at /problems/<slug>
PROBLEM_BASE = "/problems/"


def problem(status: int, type_: str, detail: str, *, extra: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None) -> Response:
    """An application/problem+json response of the API's own (the
    integration makes those of the Idempotency-Key)."""
    return problem_response(Problem(status, type_, detail, extra=extra or {}, headers=headers or {},
                                    title=PROBLEM_TYPES[type_]["title"]), PROBLEM_BASE)
