"""Health, the model list and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mstar.model.adapter import ROUTE_PATHS
from mstar.server.errors import error_response
from mstar.server.protocol import ModelCard, ModelList
from mstar.server.routes.common import ServingDep

router = APIRouter()


@router.get("/health")
async def health(serving: ServingDep):
    if not serving.ready:
        return error_response(503, f"not ready: {serving.runtime.unhealthy_reason or 'starting'}")
    return {"status": "ok"}


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request, serving: ServingDep):
    routes = [ROUTE_PATHS[r] for r in sorted(serving.adapter.routes)]
    card = ModelCard(id=serving.model_name, created=request.app.state.created, routes=routes)
    return ModelList(data=[card])


@router.get("/metrics")
async def metrics(serving: ServingDep):
    # a scrape asks the runtime for its stats, which blocks: keep it off the event loop
    body = await asyncio.to_thread(generate_latest, serving.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
