"""openpi's websocket policy protocol at ``/`` (for models whose adapter serves ``POLICY``), and
openpi's ``GET /healthz``.

A connection gets one binary frame with the policy's metadata, then answers each binary frame (one
msgpack-numpy observation) with one binary frame: the adapter's reply plus ``server_timing``
(``infer_ms``: this observation, ``prev_total_ms``: the previous one from receipt to reply sent).
A bad observation or a failed request is answered as openpi does: the error as a text frame, then
close 1011; other connections and the server go on. An API key, when set, is checked on the
handshake (openpi's ``Authorization: Api-Key K`` or ``Bearer K``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, WebSocket
from fastapi.responses import PlainTextResponse
from starlette.websockets import WebSocketDisconnect

from mstar.model.adapter import POLICY, ROUTE_PATHS
from mstar.server import policy_wire
from mstar.server.errors import APIError, internal_error, log, request_id
from mstar.server.limits import ServerLimits
from mstar.server.routes.common import ServingDep
from mstar.server.serving import Serving, Timer

router = APIRouter()

INTERNAL_ERROR = 1011
POLICY_VIOLATION = 1008


@router.get("/healthz", response_class=PlainTextResponse)
async def healthz(serving: ServingDep):
    if not serving.ready:
        return PlainTextResponse(f"not ready: {serving.runtime.unhealthy_reason or 'starting'}", status_code=503)
    return "OK"


@router.websocket("/")
async def policy(ws: WebSocket) -> None:
    state = ws.app.state
    serving: Serving = state.serving
    if POLICY not in serving.adapter.routes or not _authorized(ws, state.api_key):
        await ws.close(code=POLICY_VIOLATION)  # before accept: the handshake is refused (HTTP 403)
        return
    request_id.set(uuid.uuid4().hex[:16])  # one id per connection: logs and internal errors name it
    await ws.accept()
    await ws.send_bytes(policy_wire.pack(serving.adapter.policy_metadata()))
    prev_total_ms: float | None = None
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            t0 = time.perf_counter()
            try:
                reply = await _infer(serving, state.limits, message)
            except Exception as exc:  # noqa: BLE001 - every failure ends this connection the openpi way
                await _fail(ws, serving, exc)
                return
            reply["server_timing"] = _timing(t0, prev_total_ms)
            await ws.send_bytes(policy_wire.pack(reply))
            _count(serving, 200)
            prev_total_ms = (time.perf_counter() - t0) * 1000
    except WebSocketDisconnect:
        return


def _authorized(ws: WebSocket, api_key: str | None) -> bool:
    if not api_key:
        return True
    return ws.headers.get("authorization") in (f"Api-Key {api_key}", f"Bearer {api_key}")


async def _infer(serving: Serving, limits: ServerLimits, message: dict[str, Any]) -> dict[str, Any]:
    data = message.get("bytes")
    if data is None:
        raise APIError(400, "expected a binary frame holding a msgpack-numpy observation, got text")
    if len(data) > limits.max_body_bytes:
        raise APIError(413, f"observation of {len(data)} bytes exceeds the limit of {limits.max_body_bytes} bytes")
    timer = Timer(serving.metrics, ROUTE_PATHS[POLICY])
    try:
        obs = policy_wire.unpack(data, limits.max_tensor_elements)
        request = serving.adapter.policy_request(obs)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise APIError(400, f"bad observation: {e}") from e
    outputs: dict[str, list] = {}
    async for item in serving.stream(POLICY, request.inputs, request.params):
        outputs[item.name] = item.value
    reply = serving.adapter.policy_reply(request, outputs)
    timer.done()
    infer_ms = (time.perf_counter() - timer.t0) * 1000
    reply["policy_timing"] = {"infer_ms": infer_ms}
    return reply


def _timing(t0: float, prev_total_ms: float | None) -> dict[str, float]:
    timing = {"infer_ms": (time.perf_counter() - t0) * 1000}
    if prev_total_ms is not None:
        timing["prev_total_ms"] = prev_total_ms
    return timing


def _count(serving: Serving, status: int) -> None:
    """One observation answered (or refused), in the requests counter the HTTP routes use."""
    serving.metrics.requests.labels(serving.model_name, ROUTE_PATHS[POLICY], str(status)).inc()


async def _fail(ws: WebSocket, serving: Serving, exc: Exception) -> None:
    e = exc if isinstance(exc, APIError) else internal_error(exc)
    _count(serving, e.status)
    if e.status >= 500:
        log.warning("policy connection closed: %s", e.message)
    try:
        await ws.send_text(f"error {e.status}: {e.message}")
        await ws.close(code=INTERNAL_ERROR)
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client left first
