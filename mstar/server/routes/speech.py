"""``POST /v1/audio/speech``: a whole file (wav, pcm, flac, mp3, opus, aac), a live audio stream
(the encoded bytes as they are made; a WAV header of unknown length first) or SSE
(``speech.audio.delta`` events, then ``speech.audio.done``); ``GET /v1/audio/voices``."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

import torch
from fastapi import APIRouter
from fastapi.responses import Response

from mstar.model.adapter import SPEECH, ApiAdapter, AudioChunk
from mstar.model.reads import ReadDict
from mstar.server import audio
from mstar.server.errors import APIError
from mstar.server.protocol import SpeechRequest, Voices
from mstar.server.routes.common import (
    ClosingStreamingResponse,
    Output,
    ServingDep,
    adapt,
    ending_in_error,
    refuse_unread,
    require,
    sent_fields,
    sse,
    start,
)
from mstar.server.serving import Timer

router = APIRouter()


@router.get("/v1/audio/voices", response_model=Voices)
async def voices(serving: ServingDep):
    require(serving, SPEECH, None)
    return Voices(voices=list(serving.adapter.voices))


@router.post("/v1/audio/speech")
async def speech(req: SpeechRequest, serving: ServingDep):
    require(serving, SPEECH, req.model)
    _check(req, serving.adapter)
    body = ReadDict(req.model_dump())
    api_req = adapt(serving.adapter.speech_request, body)
    refuse_unread(sent_fields(req), body, serving.model_name, frozenset({"model", "response_format", "stream_format"}))
    request = await start(serving, SPEECH, api_req)
    rate, fmt = serving.adapter.sample_rate, req.response_format
    pcm = _pcm(request.outputs)
    if req.stream_format is None:
        chunks = [p async for p in pcm]
        samples = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int16)
        request.timer.done(samples.numel() / rate)
        data = await asyncio.to_thread(adapt, audio.encode, samples.to(torch.int16).numpy(), rate, fmt)
        return Response(data, media_type=audio.MIME[fmt])
    pcm = _timed(pcm, request.timer, rate)
    if req.stream_format == "audio":
        encoder = adapt(audio.new_encoder, fmt, rate)
        return ClosingStreamingResponse(_encoded(pcm, encoder), media_type=encoder.mime)
    # SSE: wav and pcm stream raw PCM16 deltas; the other formats their encoded bytes
    encoder = adapt(audio.new_encoder, "pcm" if fmt == "wav" else fmt, rate)
    return ClosingStreamingResponse(ending_in_error(_audio_events(_encoded(pcm, encoder))), media_type="text/event-stream")


def _check(req: SpeechRequest, adapter: ApiAdapter) -> None:
    if req.voice is not None and adapter.voices and req.voice not in adapter.voices:
        raise APIError(400, f"unknown voice {req.voice!r}; voices: {', '.join(adapter.voices)}", param="voice")
    if req.stream_format is not None and req.response_format not in audio.STREAMABLE:
        raise APIError(400, f"streaming supports response_format {', '.join(sorted(audio.STREAMABLE))}",
                       param="response_format")
    try:
        audio.check_available(req.response_format)  # a missing codec package: 400 before the model runs
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from e


async def _pcm(outputs: AsyncIterator[Output]) -> AsyncIterator[torch.Tensor]:
    async for out in outputs:
        if isinstance(out, AudioChunk):
            yield out.pcm


async def _timed(pcm: AsyncIterator[torch.Tensor], timer: Timer, rate: int) -> AsyncIterator[torch.Tensor]:
    """Time to first audio on each chunk; the real-time factor once the last one is out."""
    n = 0
    async for p in pcm:
        timer.audio()
        n += p.numel()
        yield p
    timer.done(n / rate)


async def _encoded(pcm: AsyncIterator[torch.Tensor], encoder: audio.AudioEncoder) -> AsyncIterator[bytes]:
    """Each chunk's encoded bytes as soon as the encoder has them (a codec may hold a frame back)."""
    async for p in pcm:
        data = encoder.feed(p.to(torch.int16).cpu().numpy())
        if data:
            yield data
    tail = encoder.finish()
    if tail:
        yield tail


async def _audio_events(data: AsyncIterator[bytes]) -> AsyncIterator[str]:
    async for chunk in data:
        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
    yield sse({"type": "speech.audio.done"})
