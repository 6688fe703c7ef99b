"""``WS /v1/realtime?model=...``: OpenAI's Realtime API (the subset in ``mstar.server.realtime``) for
every model that serves chat or speech. The API key, when set, is checked on the handshake
(``Authorization: Bearer K``, as the OpenAI SDK sends it); a wrong model or route is an ``error``
event, then a close with the reason."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, WebSocket

from mstar.model.adapter import CHAT, SPEECH
from mstar.server.errors import request_id
from mstar.server.realtime.events import EventError, error_event
from mstar.server.realtime.session import RealtimeSession
from mstar.server.serving import Serving

router = APIRouter()

POLICY_VIOLATION = 1008


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, model: str | None = None) -> None:
    state = ws.app.state
    serving: Serving = state.serving
    if state.api_key and ws.headers.get("authorization") != f"Bearer {state.api_key}":
        await ws.close(code=POLICY_VIOLATION)  # before accept: the handshake is refused (HTTP 403)
        return
    request_id.set(uuid.uuid4().hex[:16])  # one id per session: logs and internal errors name it
    await ws.accept()
    problem = None
    if model is not None and model != serving.model_name:
        problem = EventError(f"model {model!r} not found; this server serves {serving.model_name!r}",
                             code="model_not_found", param="model")
    elif not {CHAT, SPEECH} & serving.adapter.routes:
        problem = EventError(f"model {serving.model_name!r} serves neither chat nor speech", code="route_not_supported")
    if problem is not None:
        await ws.send_json(error_event(problem))
        await ws.close(code=POLICY_VIOLATION, reason=problem.code)
        return
    await RealtimeSession(ws, serving, state.limits).run()
