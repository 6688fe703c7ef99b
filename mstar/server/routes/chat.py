"""``POST /v1/chat/completions``: text, image and audio parts in; text, audio (one choice, in
``message.audio``) and images (``image_url`` data-URL parts) out, as one completion or as SSE chunks."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import APIRouter

from mstar.model.adapter import CHAT, AudioChunk, ImageOut, TextDelta, ToolCallsOut
from mstar.model.reads import ReadDict
from mstar.server import media
from mstar.server.errors import APIError
from mstar.server.limits import ServerLimits
from mstar.server.protocol import ChatCompletion, ChatCompletionRequest, ContentPart, refused_chat_option
from mstar.server.routes.common import (
    SSE_DONE,
    ClosingStreamingResponse,
    Limits,
    ServingDep,
    Started,
    adapt,
    choice_body,
    ending_in_error,
    merged,
    png_base64,
    refuse_unread,
    require,
    sent_fields,
    sse,
    start_choices,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat(req: ChatCompletionRequest, serving: ServingDep, limits: Limits):
    require(serving, CHAT, req.model)
    body = ReadDict(req.model_dump())
    refused = refused_chat_option(body, serving.adapter.chat_options)
    if refused is not None:
        raise APIError(400, f"{refused} is not supported by {serving.model_name} (remove it, or send its no-op value)",
                       param=refused)
    _refuse_message_extras(req, "tools" in serving.adapter.chat_options)
    images, audio = _media_inputs(req, limits)
    requests = [adapt(serving.adapter.chat_request, choice_body(body, j), images, audio) for j in range(req.n)]
    want_audio = bool(req.modalities and "audio" in req.modalities)
    text_only = not req.modalities or set(req.modalities) <= {"text"}
    refuse_unread(sent_fields(req), body, serving.model_name, _ROUTE_READS | ({"modalities"} if text_only else set())
                  | ({"audio"} if want_audio else set()))
    completion = _Completion(await start_choices(serving, CHAT, [requests]), serving.model_name, requests[0].prompt_tokens,
                             want_audio=want_audio,
                             sample_rate=serving.adapter.sample_rate,
                             audio_format=req.audio.format if req.audio else "wav", logprobs=bool(req.logprobs))
    if not req.stream:
        return await completion.collect()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    events = ending_in_error(completion.chunks(include_usage), after_error=(SSE_DONE,))
    return ClosingStreamingResponse(events, media_type="text/event-stream")


# what the chat route itself reads (``refuse_unread``); the adapter reads the rest
_ROUTE_READS = frozenset({"model", "messages", "n", "stream", "stream_options"})


def _refuse_message_extras(req: ChatCompletionRequest, tools: bool) -> None:
    """A message field no chat template here renders (``name``...) is refused; so are tool calls and
    tool results for a model without tools."""
    for i, m in enumerate(req.messages):
        extra = [k for k, v in (m.model_extra or {}).items() if v is not None]
        if not tools:
            extra += [k for k in ("tool_calls", "tool_call_id") if getattr(m, k) is not None]
        if extra:
            raise APIError(400, f"messages[{i}].{extra[0]} is not supported", param=f"messages[{i}].{extra[0]}")


def _tool_call_deltas(out: ToolCallsOut) -> list[dict]:
    """The deltas of streamed calls, as OpenAI sends them: per call, its id, name and empty arguments,
    then the arguments in pieces (the SDK joins them by ``index``)."""
    deltas = []
    for k, call in enumerate(out.calls):
        deltas.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        half = len(call.arguments) // 2
        for piece in (call.arguments[:half], call.arguments[half:]):
            if piece:
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
    return deltas


def _media_inputs(req: ChatCompletionRequest,
                  limits: ServerLimits) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
    """The image and audio parts of every message, decoded; 400 for a part that does not decode, and
    for more parts than the limits allow (counted before any is decoded)."""
    parts = [p for m in req.messages if isinstance(m.content, list) for p in m.content]
    for kind, most in (("image_url", limits.max_images), ("input_audio", limits.max_audio_clips)):
        if sum(p.type == kind for p in parts) > most:
            raise APIError(400, f"at most {most} {kind} parts per request", param="messages")
    images = [_image_input(p, limits) for p in parts if p.type == "image_url"]
    audio = [_audio_input(p, limits) for p in parts if p.type == "input_audio"]
    return images, audio


def _image_input(part: ContentPart, limits: ServerLimits) -> torch.Tensor:
    if part.image_url is None:
        raise APIError(400, "image_url part without image_url", param="messages")
    _, raw = adapt(media.decode_data_url, part.image_url.url, "image_url")
    return adapt(media.decode_image, raw, "image_url", limits.max_image_pixels, limits.max_image_side)


def _audio_input(part: ContentPart, limits: ServerLimits) -> tuple[torch.Tensor, int]:
    if part.input_audio is None:
        raise APIError(400, "input_audio part without input_audio", param="messages")
    raw = adapt(media.b64decode, part.input_audio.data, "input_audio")
    return adapt(media.decode_wav, raw, "input_audio", limits.max_audio_samples)


def _image_part(out: ImageOut) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(out.pixels)}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class _Answer:
    """What one choice has said so far."""

    text: list[str] = field(default_factory=list)
    pcm: list[torch.Tensor] = field(default_factory=list)
    images: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    tokens: int = 0


@dataclass
class _Completion:
    """One chat completion under way (``n`` choices, each its own runtime request), answered whole
    (``collect``) or streamed (``chunks``)."""

    choices: list[Started]
    model: str
    prompt_tokens: int
    want_audio: bool
    sample_rate: int
    audio_format: str = "wav"  # of message.audio.data: a WAV file, or "pcm16" raw samples
    logprobs: bool = False  # the choices carry ``logprobs.content`` (one entry per token)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    async def collect(self) -> dict:
        answers = [_Answer() for _ in self.choices]
        async for i, out in merged([c.outputs for c in self.choices]):
            a, timer = answers[i], self.choices[i].timer
            if isinstance(out, TextDelta):
                a.text.append(out.text)
                a.logprobs.extend(lp.to_openai() for lp in out.logprobs)
                a.tokens += out.num_tokens
                timer.token(out.num_tokens)
            elif isinstance(out, AudioChunk):
                timer.audio()
                a.pcm.append(out.pcm)
            elif isinstance(out, ImageOut):
                a.images.append(_image_part(out))
            elif isinstance(out, ToolCallsOut):
                a.tool_calls.extend(c.to_openai() for c in out.calls)
        choices = [self._choice(i, a) for i, a in enumerate(answers)]
        usage = _usage(self.prompt_tokens, sum(a.tokens for a in answers))
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}

    def _choice(self, index: int, a: _Answer) -> dict:
        content = "".join(a.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if a.images:  # images out: content becomes a list of parts, text first
            message["content"] = ([{"type": "text", "text": content}] if content else []) + a.images
        if a.tool_calls:
            message["content"], message["tool_calls"] = content or None, a.tool_calls
        audio_s = 0.0
        if self.want_audio and a.pcm:
            message["audio"] = self._audio(a.pcm, content)
            audio_s = sum(p.numel() for p in a.pcm) / self.sample_rate
        started = self.choices[index]
        started.timer.done(audio_s)
        choice = {"index": index, "message": message, "finish_reason": started.decoder.finish_reason}
        if self.logprobs:
            choice["logprobs"] = {"content": a.logprobs}
        return choice

    async def chunks(self, include_usage: bool) -> AsyncIterator[str]:
        n_tokens = 0
        for i in range(len(self.choices)):
            yield self._chunk(i, {"role": "assistant", "content": ""})
        async for i, out in merged([c.outputs for c in self.choices]):
            timer = self.choices[i].timer
            if isinstance(out, TextDelta):
                n_tokens += out.num_tokens
                timer.token(out.num_tokens)
                if out.logprobs:
                    yield self._chunk(i, {"content": out.text}, logprobs=[lp.to_openai() for lp in out.logprobs])
                elif out.text:
                    yield self._chunk(i, {"content": out.text})
            elif isinstance(out, AudioChunk) and self.want_audio:
                timer.audio()
                yield self._chunk(i, {"audio": {"data": base64.b64encode(media.pcm_bytes(out.pcm)).decode()}})
            elif isinstance(out, ImageOut):
                yield self._chunk(i, {"content": [_image_part(out)]})
            elif isinstance(out, ToolCallsOut):
                for chunk in _tool_call_deltas(out):
                    yield self._chunk(i, chunk)
        for i, c in enumerate(self.choices):
            yield self._chunk(i, {}, c.decoder.finish_reason)
            c.timer.done()
        if include_usage:
            yield sse({**self._head("chat.completion.chunk"), "choices": [],
                       "usage": _usage(self.prompt_tokens, n_tokens)})
        yield SSE_DONE

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, index: int, delta: dict, finish: str | None = None, logprobs: list[dict] | None = None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def _audio(self, pcm: list[torch.Tensor], transcript: str) -> dict:
        samples = torch.cat(pcm)
        if self.audio_format == "pcm16":
            data = media.pcm_bytes(samples)
        else:
            data, _ = media.encode_audio(samples, self.sample_rate, "wav")
        return {"id": f"audio_{uuid.uuid4().hex[:16]}", "data": base64.b64encode(data).decode(),
                "expires_at": self.created + 3600, "transcript": transcript}
