"""``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart: image + prompt)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any

import torch
from fastapi import APIRouter, File, Form, Request, UploadFile

from mstar.model.adapter import IMAGE_EDITS, IMAGES, ApiRequest, ImageOut
from mstar.model.reads import ReadDict
from mstar.server import media
from mstar.server.errors import APIError
from mstar.server.protocol import ImageRequest, ImagesResponse, check_json_value
from mstar.server.routes.common import (
    Limits,
    ServingDep,
    adapt,
    png_base64,
    refuse_unread,
    require,
    sent_fields,
    start,
)
from mstar.server.serving import Serving

router = APIRouter()

_EDIT_FIELDS = ("image", "prompt", "model", "n", "size")  # the form fields image_edits names


@router.post("/v1/images/generations", response_model=ImagesResponse)
async def images(req: ImageRequest, serving: ServingDep, limits: Limits):
    require(serving, IMAGES, req.model)
    body = ReadDict(req.model_dump())
    body["width"], body["height"] = _parse_size(req.size, limits.max_image_side)
    return await _run(serving, IMAGES, body, None, req.n, sent_fields(req))


@router.post("/v1/images/edits", response_model=ImagesResponse)
async def image_edits(request: Request, serving: ServingDep, limits: Limits, image: Annotated[UploadFile, File()],
                      prompt: Annotated[str, Form()], model: Annotated[str, Form()],
                      n: Annotated[int, Form()] = 1, size: Annotated[str, Form()] = "256x256"):
    require(serving, IMAGE_EDITS, model)
    if not 1 <= n <= 4:
        raise APIError(400, "n must be between 1 and 4", param="n")
    pixels = adapt(media.decode_image, await image.read(), "image", limits.max_image_pixels,
                   limits.max_image_side)
    # other form fields (the SDK's extra_body: seed, steps, guidance...) as JSON values where they parse
    extra = {k: _form_value(v) for k, v in (await request.form()).items()
             if k not in _EDIT_FIELDS and isinstance(v, str)}
    for k, v in extra.items():
        adapt(check_json_value, v, k)
    body = ReadDict({**extra, "model": model, "prompt": prompt, "n": n, "size": size})
    body["width"], body["height"] = _parse_size(size, limits.max_image_side)
    return await _run(serving, IMAGE_EDITS, body, pixels, n, sorted(extra))


async def _run(serving: Serving, route: str, body: ReadDict, image: torch.Tensor | None,
               n: int, sent: list[str]) -> ImagesResponse:
    """The n images run as n concurrent requests (the runtime batches them). Every input is validated
    before any starts, so a bad request starts nothing; nor does one setting a field (``sent``) that
    the model's adapter does not read."""
    reqs = [adapt(serving.adapter.image_request, body.with_changes(index=i), image) for i in range(n)]
    refuse_unread(sent, body, serving.model_name, _ROUTE_READS)
    tasks = [asyncio.ensure_future(_one(serving, route, r)) for r in reqs]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # one failed (or the client left): stop the others, which aborts them
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return ImagesResponse(created=int(time.time()), data=[d for r in results for d in r])


_ROUTE_READS = frozenset({"model", "n", "size", "response_format"})  # read here, not by the adapter


async def _one(serving: Serving, route: str, api_req: ApiRequest) -> list[dict]:
    request = await start(serving, route, api_req)
    outs = [out async for out in request.outputs]
    request.timer.done()
    return [{"b64_json": png_base64(o.pixels)} for o in outs if isinstance(o, ImageOut)]


def _parse_size(size: str, max_side: int) -> tuple[int, int]:
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts):  # no sign, no space
        raise APIError(400, f"size must look like 256x256, got {size[:40]!r}", param="size")
    w, h = int(parts[0]), int(parts[1])
    if not (0 < w <= max_side and 0 < h <= max_side):
        raise APIError(400, f"size must be positive and at most {max_side} per side, got {size!r}", param="size")
    return w, h


def _form_value(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v
