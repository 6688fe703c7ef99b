"""The FastAPI application: the routers of ``mstar.server.routes`` around one ``Serving``.

Handlers are module-level functions; they find the serving and the limits on ``app.state``, which
``create_app`` fills in. The middleware gives every request an id (``x-request-id``), checks the API
key and the body size, turns an unhandled exception into a logged 500 and counts requests.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from mstar.model.adapter import ROUTE_PATHS
from mstar.server.errors import error_response, install_handlers, internal_error, request_id
from mstar.server.limits import ServerLimits
from mstar.server.routes import ROUTERS
from mstar.server.serving import Serving

__all__ = ["ServerLimits", "create_app"]

# no API key: load balancers and scrapers hold none; the playground's static files (its calls send one)
_OPEN_PATHS = ("/health", "/healthz", "/metrics")
_COUNTED_PATHS = frozenset(ROUTE_PATHS.values())
DEFAULT_LIMITS = ServerLimits()


def create_app(serving: Serving, api_key: str | None = None, limits: ServerLimits = DEFAULT_LIMITS) -> FastAPI:
    app = FastAPI(title="mstar", version="0.1.0",
                  description=f"Serving {serving.model_name} with the mstar Walk Graph runtime.")
    app.state.serving = serving
    app.state.limits = limits
    app.state.api_key = api_key
    app.state.created = int(time.time())
    install_handlers(app)
    app.add_middleware(_BodyLimit, max_bytes=limits.max_body_bytes)
    app.middleware("http")(_guard)
    for router in ROUTERS:
        app.include_router(router)
    return app


async def _guard(request: Request, call_next):
    rid = _request_id(request.headers.get("x-request-id"))
    request_id.set(rid)  # seen by the handler's task, which call_next starts from this context
    response = await _checked(request, call_next)
    response.headers["x-request-id"] = rid
    return response


async def _checked(request: Request, call_next):
    state = request.app.state
    if state.api_key and request.url.path not in _OPEN_PATHS and not request.url.path.startswith("/playground"):
        if request.headers.get("authorization") != f"Bearer {state.api_key}":
            return error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                  code="invalid_api_key")
    length = request.headers.get("content-length")
    max_bytes = state.limits.max_body_bytes
    if length is not None and length.isdigit() and int(length) > max_bytes:
        return error_response(413, f"request body of {length} bytes exceeds the limit of {max_bytes} bytes")
    route = request.url.path
    try:
        response = await call_next(request)
    except Exception as exc:  # noqa: BLE001 - a handler's bug: logged with its traceback, a plain 500 out
        e = internal_error(exc)
        response = error_response(e.status, e.message, code=e.code)
    if route in _COUNTED_PATHS:
        serving = state.serving
        serving.metrics.requests.labels(serving.model_name, route, str(response.status_code)).inc()
    return response


class _BodyLimit:
    """A body sent without a length (chunked) is counted as it arrives: past the limit, reading it
    raises a 413, which the handler reading it answers (nothing past the limit is buffered). A
    declared length over the limit is refused before any byte is read (``_checked``)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # the one exception FastAPI lets out of its body parsing unchanged (it is answered as ours)
                raise HTTPException(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)


def _request_id(given: str | None) -> str:
    """The client's ``x-request-id`` when it is a short plain token, else a fresh one."""
    if given and len(given) <= 64 and given.isascii() and all(c.isalnum() or c in "-_." for c in given):
        return given
    return uuid.uuid4().hex[:16]
