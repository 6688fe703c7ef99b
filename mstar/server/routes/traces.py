"""``GET /v1/requests/{id}/trace``: the walk traces of a request the server answered (its
``x-request-id``): every runtime request it made (a chat with ``n`` choices makes ``n``), each with
its walks and their node runs (``mstar.runtime.trace``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from mstar.server.errors import APIError
from mstar.server.routes.common import ServingDep

router = APIRouter()


@router.get("/v1/requests/{request_id}/trace")
async def request_trace(request_id: str, serving: ServingDep):
    serving.check_ready()
    try:  # it waits on every rank's reply: off the event loop
        traces = await asyncio.to_thread(serving.runtime.trace, request_id)
    except (RuntimeError, TimeoutError) as e:
        raise APIError(503, f"the trace is unavailable: {e}") from e
    if not traces:
        keep = serving.runtime.placement.limits.trace_requests
        raise APIError(404, f"no trace of request {request_id!r}: unknown, or older than the last {keep} "
                            "requests the server keeps traces of (mstar serve --trace-requests)",
                       code="trace_not_found", param="request_id")
    return {"object": "request.trace", "id": request_id, "requests": traces}
