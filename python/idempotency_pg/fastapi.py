"""FastAPI: Idempotency-Key routes, mapped to HTTP as README's "Errors and
HTTP" table and draft-ietf-httpapi-idempotency-key-header say.

::

    from idempotency_pg.fastapi import idempotent_route, state_coordinator

    @app.post("/charges")
    @idempotent_route("payment.charge", coordinator=state_coordinator("coordinator"),
                      fingerprint=("charge.customer", "charge.amount", "charge.currency"),
                      status_code=201)
    async def post_charge(charge: ChargeIn, *, idempotency_key: str) -> Response: ...

The route is decorated where it is defined; its coordinator comes from a
FastAPI dependency at each request (``state_coordinator(name)`` reads
``request.app.state.<name>``, which a lifespan or startup handler sets), or
is given.  Per request, in this order:

- the ``Idempotency-Key`` header is parsed (:mod:`idempotency_pg.http`):
  missing, empty, malformed or over 255 characters -> 400 problem+json,
  before anything is claimed;
- the key is claimed (:func:`idempotency_pg.aio.idempotent`, the
  external-call shape) with the fingerprint of the endpoint's arguments that
  ``fingerprint`` names (``"charge.amount"``: the ``amount`` of the
  ``charge`` body);
- ``'new'``: the endpoint runs (it gets the key as ``key_param`` if it takes
  that parameter); its response -- a ``Response`` with a JSON body, or a
  value sent as JSON with ``status_code`` -- is stored as ``{"status",
  "headers", "body"}``, keeping only the ``replay_headers`` (``Location``,
  ``ETag``), and sent: the stored status and body, with every header the
  endpoint set.  A 5xx response is sent and not stored
  (the claim is released, as for an exception: errors are not cached);
- ``'replay'``: the stored status, headers and body, plus
  ``Idempotent-Replayed: true``;
- refusals: 409 (in progress, or ``wait_timeout`` passed) with
  ``Retry-After`` = what is left of the holding claim's lease
  (``idem_inspect``); 422 with ``stored_fingerprint`` and
  ``request_fingerprint``; 410 for a remembered key whose response expired
  (IK410); 500 for a lost claim or a response not stored; 503 when the store
  cannot be reached (unless ``on_store_error="run"``).

An exception the endpoint raises aborts the claim and goes to FastAPI's
exception handlers.  ``recover`` (extension 1.4) is called as
``recover(state, **endpoint_arguments)`` for a ``'recover'`` claim and
answers as the endpoint would.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import Response

from . import _core, aio, encoding
from .aio import AsyncCoordinator
from .errors import IdempotencyError, InProgressError
from .http import Problem, json_bytes, key_problem, parse_idempotency_key, problem_for

__all__ = ["idempotent_route", "state_coordinator", "problem_response", "stored_response",
           "PROBLEM_MEDIA_TYPE", "REPLAY_HEADERS"]

PROBLEM_MEDIA_TYPE = "application/problem+json"
REPLAY_HEADERS = ("Location", "ETag")

_REQUEST, _COORDINATOR, _KEY, _STARTED = "_idem_request", "_idem_coordinator", "_idem_key", "_idem_started"


def state_coordinator(name: str = "coordinator") -> Callable[[Request], AsyncCoordinator]:
    """A dependency returning ``request.app.state.<name>``: the coordinator
    the application made at start (lifespan, startup handler)."""
    def dependency(request: Request) -> AsyncCoordinator:
        c = getattr(request.app.state, name, None)
        if not isinstance(c, AsyncCoordinator):
            raise RuntimeError(f"app.state.{name} is not an AsyncCoordinator (set it at application start)")
        return c
    return dependency


def problem_response(problem: Problem, type_base: str | None = None) -> Response:
    """An ``application/problem+json`` response (RFC 9457)."""
    return Response(json_bytes(problem.body(type_base)), problem.status, headers=problem.headers,
                    media_type=PROBLEM_MEDIA_TYPE)


def stored_response(stored: dict[str, Any], replayed: bool, media_type: str = "application/json") -> Response:
    """A stored ``{"status", "headers", "body"}``; a replay adds
    ``Idempotent-Replayed: true``."""
    headers = dict(stored.get("headers") or {})
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    body = stored.get("body")
    return Response(b"" if body is None else json_bytes(body), int(stored["status"]), headers=headers,
                    media_type=media_type)


class _NotStored(Exception):
    """A 5xx response of the endpoint: sent, not stored (the claim is aborted)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def idempotent_route(operation: str, *, coordinator: AsyncCoordinator | Callable[..., Any],
                     fingerprint: Sequence[str] = (), status_code: int = 200,
                     replay_headers: Sequence[str] = REPLAY_HEADERS, key_param: str = "idempotency_key",
                     header: str = "Idempotency-Key", max_key_length: int = 255,
                     problem_type_base: str | None = None, media_type: str = "application/json",
                     recover: Callable[..., Any] | None = None, in_flight: str | None = None,
                     lease: _core.Duration = None, ttl: _core.Duration = None, takeover: str | None = None,
                     remember: _core.Duration = None, wait_timeout: _core.Duration = None,
                     on_store_error: str = "raise"
                     ) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Response]]]:
    """Make an ``async def`` endpoint an Idempotency-Key route (the module's
    docstring).  ``coordinator``: a FastAPI dependency returning the
    :class:`AsyncCoordinator` (such as :func:`state_coordinator`), or the
    coordinator.  ``problem_type_base`` prefixes the problem types' slugs
    (``"/problems/"`` -> ``/problems/request-in-progress``; default
    ``about:blank``).  The claim options are the decorator's
    (:func:`idempotency_pg.aio.idempotent`)."""
    dependency: Callable[..., Any]
    if isinstance(coordinator, AsyncCoordinator):
        given = coordinator

        def dependency() -> AsyncCoordinator:
            return given
    else:
        dependency = coordinator
    keep = tuple(h.lower() for h in replay_headers)

    def to_stored(result: Any) -> dict[str, Any]:
        if isinstance(result, Response):
            if result.status_code >= 500:
                raise _NotStored(result)
            raw = getattr(result, "body", None)
            if not isinstance(raw, (bytes, memoryview)):
                raise TypeError("an idempotent route stores a response with a JSON body, not a streaming one")
            body = json.loads(bytes(raw)) if raw else None
            headers = {name: value for name, value in result.headers.items() if name.lower() in keep}
            return {"status": result.status_code, "headers": headers, "body": body}
        return {"status": status_code, "headers": {}, "body": encoding.encode(result)}

    def decorate(endpoint: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Response]]:
        if not asyncio.iscoroutinefunction(endpoint):
            raise TypeError(f"{endpoint.__qualname__} must be an async def")
        try:
            hints = typing.get_type_hints(endpoint)
        except Exception:
            hints = {}
        params = [p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
                  for p in inspect.signature(endpoint).parameters.values()]
        takes_key = any(p.name == key_param for p in params)
        visible = [p for p in params if p.name != key_param]
        kw = inspect.Parameter.KEYWORD_ONLY
        # FastAPI passes the request to one parameter: the endpoint's, if it has one
        own_request = next((p.name for p in visible if p.annotation is Request), None)
        added = [] if own_request else [inspect.Parameter(_REQUEST, kw, annotation=Request)]

        def strip(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            key = kwargs.pop(_KEY)
            kwargs.pop(_COORDINATOR)
            call = kwargs.pop(_STARTED)
            call["started"] = True
            if takes_key:
                kwargs[key_param] = key
            return kwargs, call

        def keep_headers(call: dict[str, Any], result: Any) -> dict[str, Any]:
            # the first response has every header the endpoint set; a replay, the stored ones
            if isinstance(result, Response):
                call["headers"] = {k: v for k, v in result.headers.items()
                                   if k.lower() not in ("content-length", "content-type")}
            return to_stored(result)

        async def run(**kwargs: Any) -> dict[str, Any]:
            arguments, call = strip(kwargs)
            return keep_headers(call, await endpoint(**arguments))

        async def run_recover(state: Any, **kwargs: Any) -> dict[str, Any]:
            assert recover is not None
            arguments, call = strip(kwargs)
            result = recover(state, **arguments)
            if inspect.isawaitable(result):
                result = await result
            return keep_headers(call, result)

        run.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            visible + [inspect.Parameter(_KEY, kw), inspect.Parameter(_COORDINATOR, kw),
                       inspect.Parameter(_STARTED, kw)], return_annotation=dict[str, Any])
        run.__qualname__ = endpoint.__qualname__
        claimed = aio.idempotent(operation, coordinator=_COORDINATOR, fingerprint_params=fingerprint,
                                 key_param=_KEY, recover=None if recover is None else run_recover,
                                 in_flight=in_flight, lease=lease, ttl=ttl, takeover=takeover,
                                 remember=remember, wait_timeout=wait_timeout,
                                 on_store_error=on_store_error)(run)

        async def route(**kwargs: Any) -> Response:
            request: Request = kwargs[own_request] if own_request else kwargs.pop(_REQUEST)
            c: AsyncCoordinator = kwargs.pop(_COORDINATOR)
            parsed = parse_idempotency_key(request.headers.getlist(header), max_key_length)
            if parsed.key is None:
                return problem_response(key_problem(parsed), problem_type_base)
            call: dict[str, Any] = {}
            try:
                outcome = await claimed.outcome(**kwargs, **{_KEY: parsed.key, _COORDINATOR: c,
                                                             _STARTED: call})
            except _NotStored as not_stored:
                return not_stored.response
            except Exception as err:
                if call.get("started") and not isinstance(err, IdempotencyError):
                    raise     # the endpoint's own: FastAPI's exception handlers
                record = None
                if isinstance(err, InProgressError):
                    try:
                        record = await c.inspect(operation, parsed.key)
                    except Exception:
                        _core.log.exception("idem_inspect failed for key %r of %r", parsed.key, operation)
                problem = problem_for(err, record)
                if problem is None:
                    raise
                if problem.status >= 500:
                    _core.log.error("%s for key %r of %r: %s", problem.status, parsed.key, operation, err)
                return problem_response(problem, problem_type_base)
            if not outcome.replayed and "headers" in call:
                return stored_response({**outcome.value, "headers": call["headers"]}, False, media_type)
            return stored_response(outcome.value, outcome.replayed, media_type)

        route.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            visible + added + [inspect.Parameter(_COORDINATOR, kw, default=Depends(dependency))],
            return_annotation=Response)
        route.__name__ = endpoint.__name__
        route.__qualname__ = endpoint.__qualname__
        route.__doc__ = endpoint.__doc__
        route.__module__ = endpoint.__module__
        return route

    return decorate
