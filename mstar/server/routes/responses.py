"""``POST /v1/responses`` for text models: an input string or message list (plus ``instructions``)
becomes a chat request; the answer is one ``message`` output item, whole or as the Responses API's
stream events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).

``previous_response_id`` continues a conversation: every stored response (``store``, the default)
keeps its input and output messages in memory, at most ``ResponseStore.capacity`` of them and for
``ResponseStore.ttl_s`` seconds; an unknown or expired id is a 400 naming the field. As in OpenAI's
API, a previous response's ``instructions`` do not carry over."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from mstar.model.adapter import CHAT, TextDelta
from mstar.server.errors import APIError
from mstar.server.protocol import ResponsesRequest
from mstar.server.routes.common import (
    ClosingStreamingResponse,
    ServingDep,
    Started,
    adapt,
    ending_in_error,
    require,
    start,
)

router = APIRouter()

Message = dict[str, str]  # {"role", "content"}: a chat message, as the adapters read one


class ResponseStore:
    """Stored responses' conversations (input messages, then the answer), by response id: bounded
    in number (the oldest dropped first) and in age."""

    capacity = 1024
    ttl_s = 3600.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, list[Message]]] = OrderedDict()

    def get(self, response_id: str) -> list[Message] | None:
        with self._lock:
            self._expire()
            hit = self._items.get(response_id)
            return None if hit is None else list(hit[1])

    def put(self, response_id: str, messages: list[Message]) -> None:
        with self._lock:
            self._items[response_id] = (time.monotonic(), list(messages))
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            _, (at, _) = next(iter(self._items.items()))
            if now - at <= self.ttl_s:
                break
            self._items.popitem(last=False)


async def _store(request: Request) -> ResponseStore:
    store = getattr(request.app.state, "responses", None)
    if store is None:
        store = request.app.state.responses = ResponseStore()
    return store


Store = Annotated[ResponseStore, Depends(_store)]


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, serving: ServingDep, store: Store):
    require(serving, CHAT, req.model)
    extra = sorted(k for k, v in (req.model_extra or {}).items() if v is not None)
    if extra:  # every declared field is read here; nothing else is
        raise APIError(400, f"{extra[0]} is not supported", param=extra[0])
    history = _history(req, store)
    body = _chat_body(req, history)
    if body.get("logprobs") and "logprobs" not in serving.adapter.chat_options:
        raise APIError(400, f"top_logprobs is not supported by {serving.model_name}", param="top_logprobs")
    api_req = adapt(serving.adapter.chat_request, body, [], [])
    run = _Response(await start(serving, CHAT, api_req), req, serving.model_name, api_req.prompt_tokens, history, store)
    if not req.stream:
        return await run.collect()
    return ClosingStreamingResponse(ending_in_error(run.events(), frame=_error_event), media_type="text/event-stream")


def _history(req: ResponsesRequest, store: ResponseStore) -> list[Message]:
    """The conversation before this request's input: the previous response's, or none."""
    if req.previous_response_id is None:
        return []
    found = store.get(req.previous_response_id)
    if found is None:
        raise APIError(400, f"previous_response_id {req.previous_response_id!r}: no such response (unknown, "
                            f"expired, or stored with store: false)", param="previous_response_id")
    return found


def _input_messages(req: ResponsesRequest) -> list[Message]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out = []
    for m in req.input:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def _chat_body(req: ResponsesRequest, history: list[Message]) -> dict[str, Any]:
    """The chat completion body the model's adapter reads for this response."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": system + history + _input_messages(req),
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p}
    if _wants_logprobs(req):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return body


def _wants_logprobs(req: ResponsesRequest) -> bool:
    return req.top_logprobs is not None or bool(req.include)


def _error_event(body: Any) -> str:
    return f"event: error\ndata: {json.dumps({'type': 'error', **body.get('error', {})})}\n\n"


@dataclass
class _Response:
    """One response under way, answered whole (``collect``) or as stream events (``events``)."""

    started: Started
    req: ResponsesRequest
    model: str
    input_tokens: int
    history: list[Message]
    store: ResponseStore
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    item_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    output_tokens: int = 0

    def _take(self, out: Any) -> TextDelta | None:
        if not isinstance(out, TextDelta):
            return None
        self.text.append(out.text)
        self.logprobs.extend(lp.to_openai() for lp in out.logprobs)
        self.output_tokens += out.num_tokens
        self.started.timer.token(out.num_tokens)
        return out

    async def collect(self) -> dict[str, Any]:
        async for out in self.started.outputs:
            self._take(out)
        return self._finish()

    def _finish(self) -> dict[str, Any]:
        self.started.timer.done()
        if self.req.store:
            answer = {"role": "assistant", "content": "".join(self.text)}
            self.store.put(self.id, self.history + _input_messages(self.req) + [answer])
        return self._body(done=True)

    async def events(self) -> AsyncIterator[str]:
        seq = iter(range(1 << 62))
        item = {"output_index": 0, "item_id": self.item_id}
        part = {**item, "content_index": 0}
        yield _event("response.created", next(seq), response=self._body(done=False))
        yield _event("response.in_progress", next(seq), response=self._body(done=False))
        yield _event("response.output_item.added", next(seq), output_index=0, item=self._message("in_progress"))
        yield _event("response.content_part.added", next(seq), **part, part=_text_part("", None))
        async for out in self.started.outputs:
            delta = self._take(out)
            if delta is not None and (delta.text or delta.logprobs):
                yield _event("response.output_text.delta", next(seq), **part, delta=delta.text,
                             logprobs=[lp.to_openai() for lp in delta.logprobs])
        body = self._finish()
        text = "".join(self.text)
        yield _event("response.output_text.done", next(seq), **part, text=text, logprobs=self.logprobs)
        yield _event("response.content_part.done", next(seq), **part, part=_text_part(text, self._logprobs()))
        yield _event("response.output_item.done", next(seq), output_index=0, item=body["output"][0])
        # always ``response.completed`` (its response's status says "incomplete" after max_output_tokens), as
        # vLLM sends it: the SDK's ``responses.stream`` waits for that event to give the final response
        yield _event("response.completed", next(seq), response=body)

    def _logprobs(self) -> list[dict] | None:
        return self.logprobs if _wants_logprobs(self.req) else None

    def _message(self, status: str) -> dict[str, Any]:
        content = [_text_part("".join(self.text), self._logprobs())] if status != "in_progress" else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def _body(self, done: bool) -> dict[str, Any]:
        r = self.req
        truncated = done and self.started.decoder.finish_reason == "length"
        status = "in_progress" if not done else "incomplete" if truncated else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "completed_at": int(time.time()) if done else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id, "metadata": r.metadata or {},
            "temperature": r.temperature, "top_p": r.top_p, "top_logprobs": r.top_logprobs, "store": r.store,
            "parallel_tool_calls": bool(r.parallel_tool_calls), "tool_choice": r.tool_choice or "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": r.user,
            "output": [self._message("incomplete" if truncated else "completed")] if done else [],
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens}


def _text_part(text: str, logprobs: list[dict] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _event(kind: str, seq: int, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"
