"""idempotency_pg: Idempotency-Key semantics from Python, over the
``idempotency`` PostgreSQL extension (psycopg 3 and psycopg_pool).

Two coordinators with the same names and semantics:
:class:`AsyncCoordinator` (asyncio, ``AsyncConnectionPool``) and
:class:`Coordinator` (threads, ``ConnectionPool``).  Each offers the
``@coordinator.idempotent(...)`` decorator (the external-call shape) and
``coordinator.claim(conn, ...)`` (the in-transaction shape).  The SQL
contract is the extension's (README.md, "API reference"); this package only
calls it.
"""

from ._core import AsyncIdempotentFunction, ClaimState, Duration, IdempotentFunction, Outcome, current_claim
from .aio import AsyncClaim, AsyncCoordinator
from .errors import (IdempotencyError, InProgressError, InvalidRequestError, KeyReuseError,
                     LostClaimError, RecoveryNeededError, ResponseExpiredError,
                     ResponseNotStoredError, ResponseTooLargeError, translate)
from .fingerprint import fingerprint, text_form
from .sync import Claim, Coordinator

__all__ = [
    "AsyncClaim", "AsyncCoordinator", "AsyncIdempotentFunction", "Claim", "ClaimState", "Coordinator",
    "Duration", "IdempotencyError", "IdempotentFunction", "InProgressError", "InvalidRequestError",
    "KeyReuseError", "LostClaimError", "Outcome", "RecoveryNeededError", "ResponseExpiredError",
    "ResponseNotStoredError", "ResponseTooLargeError", "current_claim",
    "fingerprint", "text_form", "translate",
]
