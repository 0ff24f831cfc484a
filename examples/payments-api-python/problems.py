"""Error responses: RFC 9457 problem details (application/problem+json), and
the mapping from idempotency_pg's exceptions (one per SQLSTATE) to HTTP
statuses (README, "Errors and HTTP").  The same types and titles as
examples/payments-api/problems.js, plus IK410 (extension 1.4)."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

import psycopg
import psycopg_pool
from starlette.responses import Response

import idempotency_pg as idem

PROBLEM_TYPES: Dict[str, Dict[str, str]] = {
    "idempotency-key-missing": {
        "title": "Idempotency-Key is missing",
        "doc": "POST /charges requires an Idempotency-Key header: a unique string of 1 to 255 printable "
               "ASCII characters, sent as a quoted string, e.g. "
               'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324". '
               "Send the same key when you retry the same request."},
    "idempotency-key-malformed": {
        "title": "Idempotency-Key is malformed",
        "doc": "The Idempotency-Key header must be one quoted string (RFC 8941 String) of 1 to 255 "
               "printable ASCII characters."},
    "idempotency-key-reused": {
        "title": "Idempotency-Key is already used",
        "doc": "This operation is idempotent and it requires correct usage of Idempotency Key. "
               "Idempotency Key MUST not be reused across different payloads of this operation. "
               "The request fingerprint covers customer, amount and currency."},
    "idempotency-key-expired": {
        "title": "Idempotency-Key has expired",
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

RETRY_LATER = {"Retry-After": "1"}


def json_bytes(value: Any) -> bytes:
    """Compact JSON, as JSON.stringify writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def problem(status: int, type_: str, detail: str, *, extra: Optional[Dict[str, Any]] = None,
            headers: Optional[Dict[str, str]] = None) -> Response:
    """An application/problem+json response."""
    body = {"type": f"/problems/{type_}", "title": PROBLEM_TYPES[type_]["title"],
            "status": status, "detail": detail, **(extra or {})}
    return Response(json_bytes(body), status, headers=headers,
                    media_type="application/problem+json; charset=utf-8")


def problem_from_error(err: BaseException) -> Response:
    """The README's SQLSTATE -> HTTP table for an error of a decorated call."""
    if isinstance(err, idem.InProgressError) or getattr(err, "sqlstate", None) == "57014":
        # IK409, or statement_timeout ended the wait for the first attempt
        return problem(409, "request-in-progress", "A request with this Idempotency-Key is still "
                       "being processed. Retry later with the same key.", headers=RETRY_LATER)
    if isinstance(err, idem.KeyReuseError):
        return problem(422, "idempotency-key-reused", "This Idempotency-Key was already used for a "
                       "request with a different customer, amount or currency.",
                       extra={"stored_fingerprint": err.stored_fingerprint,
                              "request_fingerprint": err.request_fingerprint})
    if isinstance(err, idem.ResponseExpiredError):
        return problem(410, "idempotency-key-expired", "This Idempotency-Key was used for a request "
                       "that completed; its response is no longer kept.")
    if isinstance(err, idem.InvalidRequestError):
        return problem(400, "invalid-request", f"Invalid argument: {err}.")
    if isinstance(err, idem.LostClaimError):
        return problem(500, "internal-error", "This attempt lost its claim on the Idempotency-Key "
                       "before it could store its response. Retry with the same key.")
    if isinstance(err, (psycopg.OperationalError, psycopg_pool.PoolTimeout)) or \
            getattr(err, "sqlstate", None) in ("40001", "25006"):
        return problem(503, "service-unavailable", "Could not claim the Idempotency-Key; retry.",
                       headers=RETRY_LATER)
    return problem(500, "internal-error", "The server could not complete the request.")
