"""The FastAPI application: the routers of ``mstar.server.routes`` around one ``ServingEngine``.

Handlers are module-level functions; they find the engine and the limits on ``app.state``, which
``create_app`` fills in. The middleware checks the API key and the body size and counts requests.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from mstar.model.adapter import ROUTE_PATHS
from mstar.server.errors import error_response, install_handlers
from mstar.server.limits import ServerLimits
from mstar.server.routes import ROUTERS
from mstar.server.serving import ServingEngine

__all__ = ["ServerLimits", "create_app"]

_OPEN_PATHS = ("/health", "/metrics")  # no API key: load balancers and scrapers hold none
_COUNTED_PATHS = frozenset(ROUTE_PATHS.values())
DEFAULT_LIMITS = ServerLimits()


def create_app(engine: ServingEngine, api_key: str | None = None, limits: ServerLimits = DEFAULT_LIMITS) -> FastAPI:
    app = FastAPI(title="mstar", version="0.1.0",
                  description=f"Serving {engine.model_name} with the mstar Walk Graph runtime.")
    app.state.engine = engine
    app.state.limits = limits
    app.state.api_key = api_key
    app.state.created = int(time.time())
    install_handlers(app)
    app.middleware("http")(_guard)
    for router in ROUTERS:
        app.include_router(router)
    return app


async def _guard(request: Request, call_next):
    state = request.app.state
    if state.api_key and request.url.path not in _OPEN_PATHS:
        if request.headers.get("authorization") != f"Bearer {state.api_key}":
            return error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                  code="invalid_api_key")
    length = request.headers.get("content-length")
    max_bytes = state.limits.max_body_bytes
    if length is not None and length.isdigit() and int(length) > max_bytes:
        return error_response(413, f"request body of {length} bytes exceeds the limit of {max_bytes} bytes")
    route = request.url.path
    response = await call_next(request)
    if route in _COUNTED_PATHS:
        engine = state.engine
        engine.metrics.requests.labels(engine.model_name, route, str(response.status_code)).inc()
    return response
