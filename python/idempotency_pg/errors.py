"""The extension's errors as Python exceptions: one class per SQLSTATE.

Every class derives from :class:`IdempotencyError` and carries the server's
``sqlstate``, ``detail`` and ``hint``; the psycopg error it was made from is
its ``__cause__``; an error of a claim also carries its ``operation`` and
``key``.  SQLSTATEs not listed here (``40001``, ``25006``, connection
errors, a ``57014`` other than a ``wait_timeout``, ...) are raised as psycopg
raises them.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import psycopg


class IdempotencyError(Exception):
    """An error of the idempotency contract.

    Attributes: ``sqlstate`` (``None`` for errors the package raises itself),
    ``detail`` and ``hint`` (the server's DETAIL and HINT, or ``None``).
    """

    sqlstate: str | None = None
    #: the operation and the key of the claim, when the error came from one
    operation: str | None = None
    key: str | None = None

    def __init__(self, message: str, *, sqlstate: str | None = None,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        if sqlstate is not None:
            self.sqlstate = sqlstate
        self.detail = detail
        self.hint = hint


class InProgressError(IdempotencyError):
    """IK409: another attempt holds the key (``in_flight="raise"``, or this
    transaction already holds it).  HTTP: 409 Conflict, with ``Retry-After``."""

    sqlstate = "IK409"


class WaitTimeoutError(InProgressError):
    """A duplicate waited ``wait_timeout`` for the attempt that holds the key
    and gave up: the server cancelled the waiting ``idem_begin``
    (``statement_timeout``, SQLSTATE 57014), which changes nothing.
    ``operation``, ``key`` and ``wait_timeout`` (a ``timedelta``) say which.
    An :class:`InProgressError`: HTTP 409 with ``Retry-After``."""

    sqlstate = "57014"

    def __init__(self, operation: str, key: str, wait_timeout: timedelta, *,
                 detail: str | None = None) -> None:
        super().__init__(f"idempotency key {key!r} of {operation!r} is still held by another attempt "
                         f"after waiting {wait_timeout.total_seconds():g} s (wait_timeout)",
                         sqlstate="57014", detail=detail)
        self.operation = operation
        self.key = key
        self.wait_timeout = wait_timeout


class ExtensionVersionError(IdempotencyError):
    """The database's ``idempotency`` extension is older than this package
    needs (``required``, e.g. ``(1, 4)``), or is not installed in it
    (``installed`` is ``None``).  The portable edition installed into a
    schema by its psql script has no extension: its version is its
    ``idem_portable_version()``, found on the search_path (``schema`` is
    true then).  Raised at the first call of a coordinator, before any
    claim.  HTTP: 500."""

    def __init__(self, installed: str | None, required: tuple[int, int], *, schema: bool = False) -> None:
        need = ".".join(map(str, required))
        if installed is None:
            message = (f"the idempotency extension is not installed in this database; idempotency_pg "
                       f"needs version {need} or later: CREATE EXTENSION idempotency (or, for the "
                       f"portable edition installed into schema idempotency, put that schema on the "
                       f"search_path)")
        elif schema:
            message = (f"the database's idempotency (portable edition, schema install) is version "
                       f"{installed}; idempotency_pg needs {need} or later: run a newer "
                       f"idempotency--schema.sql")
        else:
            message = (f"the database's idempotency extension is version {installed}; idempotency_pg "
                       f"needs {need} or later: ALTER EXTENSION idempotency UPDATE")
        super().__init__(message)
        self.installed = installed
        self.required = required
        self.schema = schema


class KeyReuseError(IdempotencyError):
    """IK422: the key was used for a request with another fingerprint.  HTTP: 422.

    ``stored_fingerprint`` and ``request_fingerprint`` are the two
    fingerprints from the DETAIL, in hex without ``\\x`` (``None`` for a NULL
    fingerprint; one over 64 bytes is cut by the server and ends in ``...``).
    """

    sqlstate = "IK422"

    def __init__(self, message: str, *, sqlstate: str | None = None,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, sqlstate=sqlstate, detail=detail, hint=hint)
        found = [m.group(1) if m.group(1) is not None else None
                 for m in _FINGERPRINT.finditer(detail or "")]
        self.stored_fingerprint: str | None = found[0] if len(found) == 2 else None
        self.request_fingerprint: str | None = found[1] if len(found) == 2 else None


# "Stored fingerprint: \xab12. Request fingerprint: NULL." (a fingerprint
# over 64 bytes: "\x<the first 64 bytes in hex>... (100 bytes)", read as
# the hex and "...")
_FINGERPRINT = re.compile(r"\\x([0-9a-f]*(?:\.\.\.)?)|NULL")


class ResponseExpiredError(IdempotencyError):
    """IK410 (extension 1.4): the key completed, but its stored response is
    past its ttl (the key is still remembered, within ``remember``): it must
    not run again and there is nothing to replay.  HTTP: 410 Gone."""

    sqlstate = "IK410"


class LostClaimError(IdempotencyError):
    """IK412: the token no longer holds the key (the lease lapsed and another
    attempt took it over, or it was finished or aborted).  HTTP: 500."""

    sqlstate = "IK412"


class InvalidRequestError(IdempotencyError):
    """22023 (invalid argument: empty or over-long key or operation, bad
    lease or ttl, ...) or 22004 (NULL where a value is required).  HTTP: 400."""

    sqlstate = "22023"


class ResponseTooLargeError(IdempotencyError):
    """54000: the response is larger than ``idempotency.max_response_size``.
    HTTP: 500; store a reference instead."""

    sqlstate = "54000"


class RecoveryNeededError(IdempotencyError):
    """Raised by a decorated call that took over a claim with a checkpoint
    (status ``'recover'``, extension 1.4) when no ``recover=`` callback was
    given.  The claim is left pending, not aborted, so its checkpoint is kept:
    ``token`` holds the key until its lease lapses, ``state`` is the last
    checkpoint's state.  HTTP: 500."""

    def __init__(self, operation: str, key: str, token: int, state: Any) -> None:
        super().__init__(f"idempotency key {key!r} of {operation!r} was taken over with a "
                         "checkpoint, and no recover= callback was given")
        self.operation = operation
        self.key = key
        self.token = token
        self.state = state


class ResponseNotStoredError(IdempotencyError):
    """Raised by a decorated call whose function ran but whose result could
    not be stored: it cannot be encoded as JSON (a ``datetime``), it is too
    large (54000), the connection was lost twice, ...  The cause is
    ``__cause__``; ``sqlstate`` and ``detail`` are its SQLSTATE and DETAIL
    (``None`` for an error of the client, such as ``TypeError``).

    The claim is not aborted -- the effect happened -- and it is not left
    as if nothing had run: ``checkpointed`` is true when the claim has a
    checkpoint (the function's own, or one recording this failure), so that
    the next attempt gets status ``'recover'`` with it instead of ``'new'``
    (python/README.md, "When the result cannot be stored").  ``result`` is the
    function's result, as it was returned.

    A later attempt raises it too, with ``result`` ``None`` and no
    ``__cause__`` (``sqlstate`` is the first failure's), when it took over
    the failure's own checkpoint and the call has no ``recover=``: it
    completes the key with that record, and ``completed`` is true; every
    attempt after it, replaying the record, raises it the same way.
    ``storing`` is true when the server refused even the checkpoint: the
    claim stays pending and the result is stored in the background (a
    retry gets it once it is).
    HTTP: 500 (a retry's: 410, docs/http.md's ``response-not-stored``)."""

    def __init__(self, operation: str, key: str, token: int | None, result: Any, cause: BaseException | str, *,
                 sqlstate: str | None, detail: str | None, checkpointed: bool, completed: bool = False,
                 storing: bool = False) -> None:
        if isinstance(cause, str):
            then = ("the key is completed with that answer: it never runs again" if completed else
                    "the key keeps that checkpoint: after its lease the next attempt gets 'recover' again")
            message = (f"the function of {operation!r} ran for key {key!r} in an earlier attempt, but its "
                       f"result was not stored ({cause}); {then}")
        else:
            if storing:
                then = ("the claim stays pending and the result is stored in the background: a retry "
                        "gets it once it is")
            elif checkpointed:
                then = "the claim is left pending with a checkpoint: the next attempt gets 'recover'"
            else:
                then = ("the claim is left pending WITHOUT a checkpoint (the server has no idem_checkpoint, "
                        "or it failed): the next attempt after the lease gets 'new' and runs again")
            message = (f"the function of {operation!r} ran for key {key!r}, but its result was not "
                       f"stored ({type(cause).__name__}: {cause}); {then}")
        super().__init__(message, sqlstate=sqlstate, detail=detail)
        self.operation = operation
        self.key = key
        self.token = token
        self.result = result
        self.checkpointed = checkpointed
        self.completed = completed
        self.storing = storing


_BY_SQLSTATE: dict[str, type[IdempotencyError]] = {
    "IK409": InProgressError,
    "IK410": ResponseExpiredError,
    "IK412": LostClaimError,
    "IK422": KeyReuseError,
    "22023": InvalidRequestError,
    "22004": InvalidRequestError,
    "54000": ResponseTooLargeError,
}


def translate(err: psycopg.Error) -> IdempotencyError | None:
    """The :class:`IdempotencyError` for a psycopg error of the extension,
    or ``None`` for another SQLSTATE.  Raise it ``from err``."""
    cls = _BY_SQLSTATE.get(err.sqlstate or "")
    if cls is None:
        return None
    diag = err.diag
    return cls(diag.message_primary or str(err), sqlstate=err.sqlstate,
               detail=diag.message_detail, hint=diag.message_hint)
