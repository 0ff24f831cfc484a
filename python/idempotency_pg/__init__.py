"""idempotency_pg: Idempotency-Key semantics from Python, over the
``idempotency`` PostgreSQL extension (psycopg 3 and psycopg_pool).

Two coordinators with the same names and semantics:
:class:`AsyncCoordinator` (asyncio, ``AsyncConnectionPool``) and
:class:`Coordinator` (threads, ``ConnectionPool``).  Each offers the
``@coordinator.idempotent(...)`` decorator (the external-call shape) and
``coordinator.claim(conn, ...)`` (the in-transaction shape);
:func:`idempotent` is the same decorator bound to its coordinator at the
call, so that a function can be decorated where it is defined.  The SQL
contract is the extension's (docs/api.md, "API reference"); this package only
calls it.  ``idempotency_pg.fastapi`` maps it to HTTP.
"""

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Concatenate, TypeVar, overload

from . import aio, encoding, sync
from ._core import (OUTCOMES, REQUIRED_VERSION, AsyncBoundIdempotentFunction, AsyncDecorator,
                    AsyncIdempotentFunction, AsyncIdempotentMethod, Binding, BoundIdempotentFunction, ClaimState,
                    Decorator, Duration, IdempotentFunction, IdempotentMethod, Outcome, OutcomeHook, P, Record,
                    current_claim)
from .aio import AsyncClaim, AsyncCoordinator
from .errors import (ExtensionVersionError, IdempotencyError, InProgressError, InvalidRequestError,
                     KeyReuseError, LostClaimError, RecoveryNeededError, ResponseExpiredError,
                     ResponseNotStoredError, ResponseTooLargeError, WaitTimeoutError, translate)
from .fingerprint import fingerprint, text_form
from .sync import Claim, Coordinator

#: the version of this distribution, idempotency-pg (python/pyproject.toml)
__version__ = "1.6.0"

R = TypeVar("R")
S = TypeVar("S")


class _Decorator:
    """What :func:`idempotent` returns: applied to an ``async def`` it is
    :func:`idempotency_pg.aio.idempotent`, to a plain function
    :func:`idempotency_pg.sync.idempotent`."""

    def __init__(self, operation: str, options: Any) -> None:
        self._operation = operation
        self._options = options

    @overload
    def __call__(self, func: Callable[Concatenate[S, P], Awaitable[R]]  # type: ignore[misc]
                 ) -> AsyncIdempotentMethod[S, P, R]: ...

    @overload
    def __call__(self, func: Callable[P, Awaitable[R]]) -> AsyncIdempotentFunction[P, R]: ...  # type: ignore[misc]

    @overload
    def __call__(self, func: Callable[Concatenate[S, P], R]) -> IdempotentMethod[S, P, R]: ...  # type: ignore[misc]

    @overload
    def __call__(self, func: Callable[P, R]) -> IdempotentFunction[P, R]: ...

    def __call__(self, func: Callable[..., Any]) -> Any:
        import inspect
        module = aio if inspect.iscoroutinefunction(func) else sync
        return module.idempotent(self._operation, **self._options)(func)


def idempotent(operation: str, *, coordinator: Binding, fingerprint_params: Sequence[str] = (),
               key_param: str = "idempotency_key", result_type: Any | None = None,
               recover: Callable[..., Any] | None = None, in_flight: str | None = None,
               lease: Duration = None, ttl: Duration = None, takeover: str | None = None,
               remember: Duration = None, wait_timeout: Duration = None,
               on_store_error: str = "raise") -> _Decorator:
    """The decorator of :func:`idempotency_pg.aio.idempotent` (for an
    ``async def``, with an :class:`AsyncCoordinator`) or
    :func:`idempotency_pg.sync.idempotent` (a plain function, a
    :class:`Coordinator`), by the function it decorates; the arguments are
    checked when the function is decorated."""
    options = dict(coordinator=coordinator, fingerprint_params=fingerprint_params, key_param=key_param,
                   result_type=result_type, recover=recover, in_flight=in_flight, lease=lease, ttl=ttl,
                   takeover=takeover, remember=remember, wait_timeout=wait_timeout,
                   on_store_error=on_store_error)
    # the same checks as when decorating, at once
    from ._core import Overrides, policy
    Overrides.make(in_flight, lease, ttl, takeover, remember, wait_timeout)
    policy("on_store_error", on_store_error, ("raise", "run"))
    return _Decorator(operation, options)


__all__ = [
    "__version__", "AsyncBoundIdempotentFunction", "AsyncClaim", "AsyncCoordinator", "AsyncDecorator",
    "AsyncIdempotentFunction", "AsyncIdempotentMethod", "Binding", "BoundIdempotentFunction", "Claim",
    "ClaimState", "Coordinator", "Decorator", "Duration", "ExtensionVersionError", "IdempotencyError",
    "IdempotentFunction", "IdempotentMethod",
    "InProgressError", "InvalidRequestError", "KeyReuseError", "LostClaimError", "OUTCOMES", "Outcome",
    "OutcomeHook", "REQUIRED_VERSION", "Record", "RecoveryNeededError", "ResponseExpiredError",
    "ResponseNotStoredError", "ResponseTooLargeError", "WaitTimeoutError", "aio", "current_claim",
    "encoding", "fingerprint", "idempotent", "sync", "text_form", "translate",
]
