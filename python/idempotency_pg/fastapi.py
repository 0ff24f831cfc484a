"""FastAPI: Idempotency-Key routes, answering as docs/http.md ("The HTTP
contract of the packages") says -- the same table as the Node package.

::

    from idempotency_pg.fastapi import IDEMPOTENCY_RESPONSES, idempotent_route, state_coordinator

    @app.post("/charges", status_code=201, responses=IDEMPOTENCY_RESPONSES)
    @idempotent_route("payment.charge", coordinator=state_coordinator("coordinator"),
                      fingerprint=("charge.customer", "charge.amount", "charge.currency"))
    async def post_charge(charge: ChargeIn, *, idempotency_key: str) -> Response: ...

The route is decorated where it is defined; its coordinator comes from a
FastAPI dependency at each request (``state_coordinator(name)`` reads
``request.app.state.<name>``, which a lifespan or startup handler sets), or
is given.  Per request, in this order:

- the ``Idempotency-Key`` header is parsed (:mod:`idempotency_pg.http`):
  missing (unless ``required=False``: then the endpoint just runs), empty,
  malformed or over 255 characters -> 400 problem+json, before anything is
  claimed;
- the fingerprint is made of what ``fingerprint`` names
  (``"charge.amount"``: the ``amount`` of the ``charge`` body), as the
  client sent it: a body's value is read from the request's JSON (where
  FastAPI reads the parameter, each field by its alias), not from the
  model that validated it (pydantic 1 turns ``42.5`` into ``42`` for an
  ``int``); a value with no single text form (a fraction, an object) -> 400
  ``invalid-request``;
- the key is claimed (:meth:`AsyncCoordinator.begin`, the external-call
  shape); ``'new'``: ``checkpoint(**arguments)`` is recorded if given, the
  endpoint runs (with the key as ``key_param`` if it takes it) and its
  response -- a ``Response``, or a value sent as FastAPI's route sends it
  (its ``status_code``, ``response_model``, ``response_class``), or what
  the app's handler answers for an ``HTTPException`` -- is sent as it is
  (its background tasks run once, after it); it is stored as ``{"status",
  "headers", "text"}`` (the body byte for byte, or ``"base64"``; the
  ``replay_headers``, a repeated one as an array) unless its status is
  5xx, 408, 425 or 429, which release the claim (errors are not cached),
  as an exception does;
- ``'replay'``: the stored status, headers and body, plus
  ``Idempotent-Replayed: true``;
- ``'recover'``: ``recover(state, **arguments)`` answers as the endpoint
  would (when it fails, the claim keeps its checkpoint for the next
  attempt); a route without ``recover`` answers 410 ``response-not-stored``
  and stores that answer (the key never stays stuck);
- a response that cannot be stored (too large, a streaming body, the store
  lost while storing it) is sent once and the key completed with the 410
  ``response-not-stored`` answer; a value the encoder refuses cannot even be
  sent: 500 ``response-not-stored`` (and the key is completed the same way).

Never a second run once the endpoint has run.
"""

# The package's modules share _core and each other's underscored members by
# design (one package, one author): pyright's private-usage rule is for
# other people's privates.
# pyright: reportPrivateUsage=false
from __future__ import annotations

import base64
import inspect
import json
import time
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import NoneType
from typing import Any, cast

import psycopg
from fastapi import Depends, Header, Request, params
from fastapi.datastructures import DefaultPlaceholder
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import Response
from fastapi.routing import APIRoute, serialize_response
from fastapi.utils import is_body_allowed_for_status_code
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from . import _core
from .aio import AsyncClaim, AsyncCoordinator, _shielded, _unreachable
from .errors import IdempotencyError, InProgressError, LostClaimError
from .fingerprint import fingerprint as make_fingerprint
from .http import (PROBLEM_MEDIA_TYPE, Problem, json_bytes, key_problem, not_stored_problem,
                   parse_idempotency_key, problem_for, retry_after)

__all__ = ["idempotent_route", "state_coordinator", "problem_response", "stored_response",
           "IDEMPOTENCY_RESPONSES", "PROBLEM_MEDIA_TYPE", "REPLAY_HEADERS", "stored_status"]

REPLAY_HEADERS = ("Location", "ETag")
#: kept with every response, whatever ``replay_headers`` says: what the
#: stored bytes are, and what they were chosen by
BODY_HEADERS = ("content-type", "content-encoding", "vary")

_REQUEST, _COORDINATOR, _HEADER = "_idem_request", "_idem_coordinator", "_idem_header"

_PROBLEM = {"content": {PROBLEM_MEDIA_TYPE: {"schema": {"type": "object"}}}}
#: the answers an Idempotency-Key route adds, for the route's ``responses=``
#: (OpenAPI): ``@app.post(path, status_code=201, responses=IDEMPOTENCY_RESPONSES)``
IDEMPOTENCY_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Idempotency-Key missing or malformed, or a fingerprinted value with no "
                         "single text form", **_PROBLEM},
    409: {"description": "A request with this Idempotency-Key is in progress (Retry-After)", **_PROBLEM},
    410: {"description": "The key's response is gone: expired, or never stored", **_PROBLEM},
    422: {"description": "Idempotency-Key reused with another request (type ...idempotency-key-reused)",
          **_PROBLEM},
    503: {"description": "The idempotency store cannot be reached (Retry-After)", **_PROBLEM},
}

#: statuses that say "try again later": sent, not stored (with every 5xx)
NOT_STORED_STATUSES = frozenset((408, 425, 429))


def stored_status(status: int) -> bool:
    """Is a response of this status the request's answer, stored and
    replayed?  Below 500, and not 408, 425 or 429."""
    return status < 500 and status not in NOT_STORED_STATUSES


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


def stored_response(stored: Mapping[str, Any], replayed: bool, media_type: str = "application/json") -> Response:
    """A stored response: ``{"status", "headers", "text"}`` (or ``"base64"``,
    or a JSON ``"body"``, as an application's own ``idem_finish`` may write
    it), with exactly the stored headers (a header sent more than once is
    stored as an array of its values); a ``"body"`` without a Content-Type
    gets ``media_type``.  A replay adds ``Idempotent-Replayed: true``."""
    headers = cast(Mapping[str, str | list[str]], stored.get("headers") or {})
    if isinstance(stored.get("text"), str):
        content = stored["text"].encode()
    elif isinstance(stored.get("base64"), str):
        content = base64.b64decode(stored["base64"])
    elif stored.get("body") is not None:
        content = json_bytes(stored["body"])
        if not any(name.lower() == "content-type" for name in headers):
            headers = {**headers, "content-type": media_type}
    else:
        content = b""
    response = Response(content, int(stored["status"]))
    for name, value in headers.items():
        for one in value if isinstance(value, list) else [value]:
            response.headers.append(name, str(one))
    if replayed:
        response.headers.append("Idempotent-Replayed", "true")
    return response


class _Durations:
    """The mean duration of an operation's completed attempts in this
    process: the estimate behind a 409's ``Retry-After``."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class _Unsendable(Exception):
    """The endpoint's value cannot be serialized: there is no response to send."""


def _header_record(response: Response, keep: Sequence[str]) -> dict[str, str | list[str]]:
    """The headers of ``response`` named in ``keep`` (lower case), as a
    record keeps them: one value as a string, a header sent more than once
    as the array of its values."""
    values: dict[str, list[str]] = {}
    for name, value in response.headers.items():
        if name.lower() in keep:
            values.setdefault(name.lower(), []).append(value)
    return {name: v[0] if len(v) == 1 else v for name, v in values.items()}


async def _exception_response(request: Request, exc: HTTPException) -> Response:
    """What the app's handler for ``exc`` answers, found as Starlette finds
    it (by status code, then by class); FastAPI's own without one."""
    handlers: Mapping[Any, Callable[..., Any]] = request.app.exception_handlers
    found = [handlers[k] for k in (exc.status_code, *type(exc).__mro__) if k in handlers]
    response = found[0](request, exc) if found else http_exception_handler(request, exc)
    if inspect.isawaitable(response):
        response = await response
    return cast(Response, response)


def idempotent_route(operation: str, *, coordinator: AsyncCoordinator | Callable[..., Any],
                     fingerprint: Sequence[str] = (), status_code: int | None = None,
                     replay_headers: Sequence[str] = REPLAY_HEADERS, key_param: str = "idempotency_key",
                     header: str = "Idempotency-Key", max_key_length: int = 255,
                     problem_type_base: str | None = None, media_type: str = "application/json",
                     required: bool = True, checkpoint: Callable[..., Any] | None = None,
                     recover: Callable[..., Any] | None = None, in_flight: str | None = None,
                     lease: _core.Duration = None, ttl: _core.Duration = None, takeover: str | None = None,
                     remember: _core.Duration = None, wait_timeout: _core.Duration = None,
                     on_store_error: str = "raise"
                     ) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[Response]]]:
    """Make an endpoint (``async def``, or ``def``: run in FastAPI's
    threadpool) an Idempotency-Key route (the module's docstring,
    docs/http.md).  A value it returns is sent as FastAPI sends it, with
    the route's ``status_code``, ``response_model`` and ``response_class``
    (``@app.post(...)``'s); ``status_code`` here, if given, must be the
    route's.  ``media_type``: the Content-Type of a replayed record with a
    JSON ``"body"`` (written by SQL) that has none.  ``coordinator``: a FastAPI dependency
    returning the :class:`AsyncCoordinator` (such as
    :func:`state_coordinator`), or the coordinator.  ``problem_type_base``
    prefixes the problem types' slugs (default ``urn:idempotency:problem:``).
    ``required=False``: a request without the header runs the endpoint
    without idempotency.  ``checkpoint(**arguments)`` (it may be async)
    gives a state, computed before the claim and recorded by the claim's
    own statement when the claim is new; a route with a
    ``checkpoint`` must have a ``recover(state, **arguments)``
    (``TypeError`` here otherwise).  The claim options are the decorator's
    (:func:`idempotency_pg.aio.idempotent`)."""
    if checkpoint is not None and recover is None:
        raise TypeError(f"the route of {operation!r} declares a checkpoint and no recover=: after a "
                        "takeover its key could only answer response-not-stored (docs/http.md)")
    if isinstance(fingerprint, str):
        raise TypeError("fingerprint must be a sequence of parameter names, not a str")
    overrides = _core.Overrides.make(in_flight, lease, ttl, takeover, remember, wait_timeout)
    fail_open = _core.policy("on_store_error", on_store_error, ("raise", "run")) == "run"
    if isinstance(coordinator, AsyncCoordinator):
        given = coordinator

        def given_coordinator() -> AsyncCoordinator:
            return given
        dependency: Callable[..., Any] = given_coordinator
    else:
        dependency = coordinator
    keep = tuple(dict.fromkeys([*(h.lower() for h in replay_headers), *BODY_HEADERS]))
    # without recover=, the endpoint's own checkpoints are refused
    refusal = None if recover is not None else (
        f"the endpoint of {operation!r} checkpoints its claim, but the route has no recover=: the "
        "attempt that takes the key over would have nothing to answer 'recover' with; pass recover=")
    paths = tuple(tuple(name.split(".")) for name in fingerprint)
    durations = _Durations()

    def decorate(endpoint: Callable[..., Any]) -> Callable[..., Awaitable[Response]]:
        try:
            hints = typing.get_type_hints(endpoint)
        except Exception:
            hints = {}
        params = [p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
                  for p in inspect.signature(endpoint).parameters.values()]
        names = {p.name for p in params}
        returns = hints.get("return", inspect.Signature.empty)
        if returns is NoneType:
            returns = None
        for path in paths:
            if path[0] not in names:
                raise TypeError(f"fingerprint parameter {'.'.join(path)!r} is not a parameter of "
                                f"{endpoint.__qualname__}")
        takes_key = key_param in names
        visible = [p for p in params if p.name != key_param]
        kw = inspect.Parameter.KEYWORD_ONLY
        # FastAPI passes the request to one parameter: the endpoint's, if it has one
        own_request = next((p.name for p in visible if p.annotation is Request), None)
        added = [] if own_request else [inspect.Parameter(_REQUEST, kw, annotation=Request)]

        # the endpoint's own Response parameter (FastAPI's "sub-response"):
        # the status and headers the endpoint sets on it go with its value
        own_response = next((p.name for p in visible if isinstance(p.annotation, type)
                             and issubclass(p.annotation, Response)), None)
        # a def endpoint (or recover) runs in FastAPI's threadpool, as FastAPI runs it
        endpoint_threaded = not _is_async(endpoint)
        recover_threaded = recover is not None and not _is_async(recover)

        def declared(request: Request) -> APIRoute:
            """FastAPI's route that serves ``request`` (FastAPI puts it in the
            scope)."""
            api = request.scope.get("route")
            if not isinstance(api, APIRoute):
                raise RuntimeError(f"{endpoint.__qualname__} is not served by a FastAPI route: declare it "
                                   "with @app.post(...) or an APIRouter's")
            if status_code is not None and api.status_code != status_code:
                raise TypeError(f"the route of {operation!r} has status_code={status_code}, and its "
                                f"FastAPI route {api.path} status_code={api.status_code}: declare it once, "
                                "on the FastAPI route")
            return api

        async def to_response(request: Request, result: Any, sub: Response | None) -> Response:
            """The endpoint's response: as it returned it, or its value sent
            as the route would send it (FastAPI's get_request_handler), with
            the status and headers set on its Response parameter ``sub``."""
            if isinstance(result, Response):
                return result
            api = declared(request)
            response_class: type[Response] = (api.response_class.value if isinstance(
                api.response_class, DefaultPlaceholder) else api.response_class)
            try:
                content = await serialize_response(
                    field=api.response_field, response_content=result, include=api.response_model_include,
                    exclude=api.response_model_exclude, by_alias=api.response_model_by_alias,
                    exclude_unset=api.response_model_exclude_unset,
                    exclude_defaults=api.response_model_exclude_defaults,
                    exclude_none=api.response_model_exclude_none)
                response = (response_class(content) if api.status_code is None
                            else response_class(content, api.status_code))
            except (TypeError, ValueError) as err:
                raise _Unsendable(f"{type(err).__name__}: {err}") from err
            if sub is not None:
                if sub.status_code:
                    response.status_code = sub.status_code
                response.headers.raw.extend(sub.headers.raw)
            if not is_body_allowed_for_status_code(response.status_code):
                response.body = b""
                del response.headers["content-length"]
            return response

        async def run(request: Request, answer: Callable[..., Any], threaded: bool, arguments: dict[str, Any],
                      *prefix: Any) -> Response:
            """The response of ``answer`` (the endpoint, or ``recover`` with
            the checkpoint's state as ``prefix``), run as FastAPI runs an
            endpoint (``threaded``: in its threadpool); an ``HTTPException``
            it raises is answered by the app's handler, as a response it
            returned."""
            try:
                if threaded:
                    result = await run_in_threadpool(answer, *prefix, **arguments)
                else:
                    result = await answer(*prefix, **arguments)
            except HTTPException as exc:
                return await _exception_response(request, exc)
            sub = arguments.get(own_response) if own_response else None
            return await to_response(request, result, sub if isinstance(sub, Response) else None)

        def record_of(response: Response) -> dict[str, Any] | None:
            """The response to store, or ``None`` when it has no body to keep
            (a streaming response).  A body that is not UTF-8 text, or has a
            NUL (jsonb has none), is kept as base64."""
            raw = getattr(response, "body", None)
            if not isinstance(raw, (bytes, memoryview)):
                return None
            data = raw if isinstance(raw, bytes) else raw.tobytes()
            record: dict[str, Any] = {"status": response.status_code, "headers": _header_record(response, keep)}
            try:
                text: str | None = data.decode()
            except UnicodeDecodeError:
                text = None
            if text is None or "\0" in text:
                record["base64"] = base64.b64encode(data).decode()
            else:
                record["text"] = text
            return record

        def problem(p: Problem) -> Response:
            return problem_response(p, problem_type_base)

        def not_stored_record() -> dict[str, Any]:
            p = not_stored_problem(410)
            return {"status": 410, "headers": {"content-type": PROBLEM_MEDIA_TYPE},
                    "text": json_bytes(p.body(problem_type_base)).decode()}

        async def complete_not_stored(claim: AsyncClaim, why: str, stored: dict[str, Any] | None = None) -> bool:
            """Complete the key with the 410 response-not-stored answer: the
            endpoint ran (or may have), its response (``stored``) is not
            kept.  If that answer cannot be stored either, the claim gets a
            checkpoint saying so (unless it has one), so that an attempt
            that takes it over gets 'recover', not 'new'; and if the server
            refused the answer, ``stored`` and the answer are stored in the
            background: then ``True`` (docs/http.md)."""
            _core.log.error("the response of %r for key %r was not stored (%s): the key answers "
                            "410 response-not-stored", operation, claim.key, why)
            answer = not_stored_record()
            try:
                await claim.finish(answer)
                return False
            except Exception as err:
                _core.log.exception("could not store the response-not-stored answer for key %r of %r",
                                    claim.key, operation)
                failed = err
            if not claim.checkpointed:
                try:
                    await claim._rescue(_core.CHECKPOINT_SQL, claim._params(
                        state=_core.to_json({"response_not_stored": {"error": why[:1000]}})))
                    claim.checkpointed = True
                except Exception:
                    _core.log.exception("idem_checkpoint failed for key %r of %r", claim.key, operation)
            return claim._store_later(failed, *([answer] if stored is None else [stored, answer]))

        async def conclude(claim: AsyncClaim, response: Response | _Unsendable, started: float) -> Response:
            """What the request answers once the endpoint (or ``recover``) has
            run: its response, stored unless its status says "try again"
            (the claim is then given up); else the response-not-stored
            answers."""
            if isinstance(response, _Unsendable):
                await complete_not_stored(claim, str(response))
                return problem(not_stored_problem(500))
            if not stored_status(response.status_code):
                await _give_up(claim)
                return response
            stored = record_of(response)
            if stored is None:
                await complete_not_stored(claim, "a streaming response")
                return response
            try:
                await claim.finish(stored)
            except LostClaimError:
                _core.log.error("the endpoint of %r ran for key %r, but the claim was taken over "
                                "before its response was stored", operation, claim.key)
                return problem(not_stored_problem(500))
            except (IdempotencyError, psycopg.Error, TypeError, ValueError) as err:
                if await complete_not_stored(claim, f"{type(err).__name__}: {err}", stored):
                    return problem(not_stored_problem(500, later=True))
                return response
            durations.add(time.monotonic() - started)
            return response

        async def call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            result = func(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return result

        async def route(**kwargs: Any) -> Response:
            request: Request = kwargs[own_request] if own_request else kwargs.pop(_REQUEST)
            c: AsyncCoordinator = kwargs.pop(_COORDINATOR)
            kwargs.pop(_HEADER, None)
            values = request.headers.getlist(header)
            parsed = parse_idempotency_key(values, max_key_length)
            arguments = dict(kwargs)
            if request.method == "HEAD":
                # safe by definition: a route that also serves HEAD runs it without idempotency
                if takes_key:
                    arguments[key_param] = parsed.key
                return await run(request, endpoint, endpoint_threaded, arguments)
            if parsed.key is None:
                if parsed.missing and not values and not required:
                    if takes_key:
                        arguments[key_param] = None
                    return await run(request, endpoint, endpoint_threaded, arguments)
                return problem(key_problem(parsed))
            key = parsed.key
            if takes_key:
                arguments[key_param] = key
            api = declared(request)
            try:
                fp = make_fingerprint(*await _fingerprint_values(request, paths, kwargs, api))
            except (TypeError, ValueError) as err:
                return problem(Problem(400, "invalid-request", f"Invalid request: {err}."))
            # the checkpoint's state goes with the claim, recorded by its
            # statement if the claim is new
            state = None if checkpoint is None else _core.to_json(await call(checkpoint, **arguments))
            try:
                claim = await c._begin(operation, key, fp, overrides.apply(c.settings),
                                       overrides.wait_timeout or c.wait_timeout, state)
            except Exception as err:
                if fail_open and await _unreachable(c, err):
                    _core.log.error("the store is unreachable (%s: %s): running %r for key %r without "
                                    "a claim (on_store_error=\"run\")", type(err).__name__, err, operation, key)
                    c._report(operation, key, "store_error")
                    return await run(request, endpoint, endpoint_threaded, arguments)
                record = None
                if isinstance(err, InProgressError):
                    try:
                        record = await c.inspect(operation, key)
                    except Exception:
                        _core.log.exception("idem_inspect failed for key %r of %r", key, operation)
                p = problem_for(err, retry_after(record, durations.mean()))
                if p is None:
                    raise
                if p.status >= 500:
                    _core.log.error("%s for key %r of %r: %s", p.status, key, operation, err)
                return problem(p)
            if claim.status == "replay":
                return stored_response(claim.response, True, media_type)
            claim._checkpoint_refusal = refusal
            started = time.monotonic()
            try:
                with _core.running(claim):
                    answer: Callable[..., Any] = endpoint
                    threaded = endpoint_threaded
                    prefix: tuple[Any, ...] = ()
                    if claim.status == "recover":
                        if recover is None:
                            await complete_not_stored(claim, "taken over with a checkpoint, and the "
                                                      "route has no recover=")
                            return problem(not_stored_problem(410))
                        answer, threaded, prefix = recover, recover_threaded, (claim.response,)

                    async def answered() -> Response:
                        try:
                            response: Response | _Unsendable = await run(request, answer, threaded, arguments, *prefix)
                        except _Unsendable as err:
                            response = err
                        except BaseException:
                            await _give_up(claim)
                            raise
                        # the endpoint has run: a cancellation of the request
                        # (a timeout) waits until its response is stored, or recorded
                        return await _shielded(conclude(claim, response, started))

                    # a thread cannot be stopped: a cancellation that comes
                    # once a def endpoint has started waits for its response
                    return await (_shielded(answered()) if threaded else answered())
            finally:
                # a claim left pending: its connection is closed
                await claim.abandon()

        route.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            visible + added + [
                inspect.Parameter(_HEADER, kw, annotation=str | None,
                                  default=Header(None, alias=header, description=(
                                      "A unique key per request (RFC 8941 String or bare token, "
                                      f"1 to {max_key_length} characters); retries send the same key"
                                      + ("" if required else "; optional")))),
                inspect.Parameter(_COORDINATOR, kw, default=Depends(dependency))],
            # FastAPI infers the response model from it, as for the endpoint itself
            return_annotation=returns)
        route.__name__ = endpoint.__name__
        route.__qualname__ = endpoint.__qualname__
        route.__doc__ = endpoint.__doc__
        route.__module__ = endpoint.__module__
        return route

    return decorate


def _is_async(func: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (as
    FastAPI tells them apart)."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


async def _give_up(claim: AsyncClaim) -> None:
    """The endpoint (or ``recover``) failed: a new claim is released
    (``idem_abort``); a ``'recover'`` claim is left pending with its
    checkpoint (its connection is closed), so the next attempt gets
    ``'recover'`` again."""
    if claim.status == "recover":
        return
    try:
        await claim.abort()
    except Exception:  # the lease (or the session's end) releases it
        _core.log.exception("idem_abort failed for key %r of %r", claim.key, claim.operation)


_NOT_SENT = object()


async def _fingerprint_values(request: Request, paths: Sequence[tuple[str, ...]], kwargs: Mapping[str, Any],
                              api: APIRoute) -> list[Any]:
    """The fingerprinted values: a part of the JSON body as the client sent
    it (the request's JSON, found as FastAPI finds the parameter in it,
    each field by its alias), checked to have one text form; any other as
    the endpoint gets it.  ``ValueError`` when the value sent cannot be
    found: never the value pydantic converted."""
    body_fields = {f.name: f for f in api.dependant.body_params if not isinstance(f.field_info, params.Form)}
    raw: Any = _NOT_SENT
    out: list[Any] = []
    for path in paths:
        value = kwargs[path[0]]
        name = ".".join(path)
        field = body_fields.get(path[0])
        if field is None:
            out.append(_core._path_value(value, path[1:]))
            continue
        if raw is _NOT_SENT:
            try:
                raw = json.loads(await request.body() or b"null")
            except ValueError:
                raw = None
        # one body parameter is the whole body (unless embedded); several are its members
        node: Any = raw if api.body_field is field else _member(name, raw, [field.alias])
        for attr in path[1:]:
            if node is _NOT_SENT or (node is None and value is None):
                value = None if value is None else _core._path_value(value, (attr,))
                continue
            node = _member(name, node, _aliases(value, attr))
            value = _core._path_value(value, (attr,))
        out.append(value if node is _NOT_SENT else _sent_value(name, node))
    return out


def _member(name: str, node: Any, keys: Sequence[str]) -> Any:
    """The member of a JSON object the client sent under the first of
    ``keys`` that it has (``_NOT_SENT``: none: the field's default);
    ``ValueError`` when ``node`` is no object."""
    if node is None:
        return _NOT_SENT
    if not isinstance(node, dict):
        raise ValueError(f"the request's JSON has no object for {name}")
    sent = cast(dict[str, Any], node)
    return next((sent[k] for k in keys if k in sent), _NOT_SENT)


def _aliases(value: object, attr: str) -> list[str]:
    """The names a model's field ``attr`` may be sent under: its alias
    (pydantic 1 or 2), then its name."""
    model = type(value)
    fields = cast(Mapping[str, Any], getattr(model, "model_fields", None) or getattr(model, "__fields__", None) or {})
    alias = getattr(fields.get(attr), "alias", None)
    return [alias, attr] if isinstance(alias, str) and alias != attr else [attr]


def _sent_value(name: str, value: Any) -> Any:
    """A value of the request's JSON as the fingerprint takes it: a string, an
    integer (``42.0`` is ``42``), a boolean or null; ``ValueError`` for one
    with no single text form (``42.5``, an object, an array)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{name} is {json.dumps(value)[:40]}, which has no single text form to fingerprint")
