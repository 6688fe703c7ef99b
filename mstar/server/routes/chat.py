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

from mstar.model.adapter import CHAT, AudioChunk, ImageOut, TextDelta
from mstar.server import media
from mstar.server.errors import APIError
from mstar.server.limits import ServerLimits
from mstar.server.protocol import ChatCompletion, ChatCompletionRequest, ContentPart
from mstar.server.routes.common import (
    SSE_DONE,
    ClosingStreamingResponse,
    Engine,
    Limits,
    Started,
    adapt,
    ending_in_error,
    png_base64,
    require,
    sse,
    start,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat(req: ChatCompletionRequest, engine: Engine, limits: Limits):
    require(engine, CHAT, req.model)
    images, audio = _media_inputs(req, limits)
    api_req = adapt(engine.adapter.chat_request, req.model_dump(), images, audio)
    completion = _Completion(await start(engine, CHAT, api_req), engine.model_name, api_req.prompt_tokens,
                             want_audio=bool(req.modalities and "audio" in req.modalities),
                             sample_rate=engine.adapter.sample_rate,
                             audio_format=req.audio.format if req.audio else "wav")
    if not req.stream:
        return await completion.collect()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    events = ending_in_error(completion.chunks(include_usage), after_error=(SSE_DONE,))
    return ClosingStreamingResponse(events, media_type="text/event-stream")


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
class _Completion:
    """One chat completion under way, answered whole (``collect``) or streamed (``chunks``)."""

    request: Started
    model: str
    prompt_tokens: int
    want_audio: bool
    sample_rate: int
    audio_format: str = "wav"  # of message.audio.data: a WAV file, or "pcm16" raw samples
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    async def collect(self) -> dict:
        text, pcm, images, n_tokens = [], [], [], 0
        timer = self.request.timer
        async for out in self.request.outputs:
            if isinstance(out, TextDelta):
                text.append(out.text)
                n_tokens += out.num_tokens
                timer.token(out.num_tokens)
            elif isinstance(out, AudioChunk):
                timer.audio()
                pcm.append(out.pcm)
            elif isinstance(out, ImageOut):
                images.append(_image_part(out))
        content = "".join(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if images:  # images out: content becomes a list of parts, text first
            message["content"] = ([{"type": "text", "text": content}] if content else []) + images
        audio_s = 0.0
        if self.want_audio and pcm:
            message["audio"] = self._audio(pcm, content)
            audio_s = sum(p.numel() for p in pcm) / self.sample_rate
        timer.done(audio_s)
        choice = {"index": 0, "message": message, "finish_reason": self.request.decoder.finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": _usage(self.prompt_tokens, n_tokens)}

    async def chunks(self, include_usage: bool) -> AsyncIterator[str]:
        timer, n_tokens = self.request.timer, 0
        yield self._chunk({"role": "assistant", "content": ""})
        async for out in self.request.outputs:
            if isinstance(out, TextDelta):
                n_tokens += out.num_tokens
                timer.token(out.num_tokens)
                if out.text:
                    yield self._chunk({"content": out.text})
            elif isinstance(out, AudioChunk) and self.want_audio:
                timer.audio()
                yield self._chunk({"audio": {"data": base64.b64encode(media.pcm_bytes(out.pcm)).decode()}})
            elif isinstance(out, ImageOut):
                yield self._chunk({"content": [_image_part(out)]})
        yield self._chunk({}, self.request.decoder.finish_reason)
        if include_usage:
            yield sse({**self._head("chat.completion.chunk"), "choices": [],
                       "usage": _usage(self.prompt_tokens, n_tokens)})
        timer.done()
        yield SSE_DONE

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def _audio(self, pcm: list[torch.Tensor], transcript: str) -> dict:
        samples = torch.cat(pcm)
        if self.audio_format == "pcm16":
            data = media.pcm_bytes(samples)
        else:
            data, _ = media.encode_audio(samples, self.sample_rate, "wav")
        return {"id": f"audio_{uuid.uuid4().hex[:16]}", "data": base64.b64encode(data).decode(),
                "expires_at": self.created + 3600, "transcript": transcript}
