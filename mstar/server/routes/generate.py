"""The native route: ``POST /generate`` takes tensors by input name and streams every emitted item as
one NDJSON line, then ``{"done": true}``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter

from mstar.model.adapter import GENERATE, ApiAdapter, ApiRequest
from mstar.runtime.handles import StreamItem
from mstar.server import media
from mstar.server.protocol import GenerateRequest
from mstar.server.routes.common import (
    ClosingStreamingResponse,
    Limits,
    ServingDep,
    adapt,
    ending_in_error,
    ndjson,
    require,
    started,
)

router = APIRouter()


@router.post("/generate")
async def generate(req: GenerateRequest, serving: ServingDep, limits: Limits):
    require(serving, GENERATE, None)
    inputs = {k: adapt(media.tensor_from_json, v, f"inputs.{k}", limits.max_tensor_elements,
                       limits.max_tensor_dims) for k, v in req.inputs.items()}
    params = req.params.model_dump(exclude_unset=True, exclude_none=True)  # range-checked, unset left out
    api_req = adapt(serving.adapter.generate_request, inputs, params)
    items = await started(serving, GENERATE, api_req.inputs, api_req.params)
    lines = _lines(items, serving.adapter, api_req)
    return ClosingStreamingResponse(ending_in_error(lines, frame=ndjson), media_type="application/x-ndjson")


async def _lines(items: AsyncIterator[StreamItem], adapter: ApiAdapter, api_req: ApiRequest) -> AsyncIterator[str]:
    async for item in items:
        tensors = adapter.generate_outputs(api_req, item.name, item.value)
        yield ndjson({"name": item.name, "modality": item.modality, "node": item.node, "walk": item.walk,
                      "tensors": [media.tensor_to_json(t) for t in tensors]})
    yield ndjson({"done": True})
