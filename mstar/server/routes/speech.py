"""``POST /v1/audio/speech``: a whole file (wav, pcm, flac), a live audio stream (one WAV header of
unknown length, then PCM as it is made) or SSE (``speech.audio.delta`` events, then
``speech.audio.done``); ``GET /v1/audio/voices``."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import torch
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from mstar.model.adapter import SPEECH, ApiAdapter, AudioChunk
from mstar.server import media
from mstar.server.errors import APIError
from mstar.server.protocol import SpeechRequest, Voices
from mstar.server.routes.common import Engine, Output, adapt, ending_in_error, require, sse, start
from mstar.server.serving import Timer

router = APIRouter()


@router.get("/v1/audio/voices", response_model=Voices)
async def voices(engine: Engine):
    require(engine, SPEECH, None)
    return Voices(voices=list(engine.adapter.voices))


@router.post("/v1/audio/speech")
async def speech(req: SpeechRequest, engine: Engine):
    require(engine, SPEECH, req.model)
    _check(req, engine.adapter)
    api_req = adapt(engine.adapter.speech_request, req.model_dump())
    request = await start(engine, SPEECH, api_req)
    rate = engine.adapter.sample_rate
    pcm = _pcm(request.outputs)
    if req.stream_format is None:
        chunks = [p async for p in pcm]
        audio = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int16)
        request.timer.done(audio.numel() / rate)
        data, mime = adapt(media.encode_audio, audio, rate, req.response_format)
        return Response(data, media_type=mime)
    pcm = _timed(pcm, request.timer, rate)
    if req.stream_format == "audio":
        wav = req.response_format == "wav"
        return StreamingResponse(_audio_bytes(pcm, rate, wav), media_type="audio/wav" if wav else "audio/pcm")
    return StreamingResponse(ending_in_error(_audio_events(pcm)), media_type="text/event-stream")


def _check(req: SpeechRequest, adapter: ApiAdapter) -> None:
    if req.voice is not None and adapter.voices and req.voice not in adapter.voices:
        raise APIError(400, f"unknown voice {req.voice!r}; voices: {', '.join(adapter.voices)}", param="voice")
    if req.response_format not in ("wav", "pcm", "flac"):
        raise APIError(400, f"response_format {req.response_format!r} is not supported; use wav, pcm or flac",
                       param="response_format")
    if req.stream_format is not None and req.response_format not in ("wav", "pcm"):
        raise APIError(400, "streaming supports response_format wav or pcm", param="response_format")


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


async def _audio_bytes(pcm: AsyncIterator[torch.Tensor], rate: int, wav: bool) -> AsyncIterator[bytes]:
    if wav:
        yield media.wav_header(rate)
    async for p in pcm:
        yield media.pcm_bytes(p)


async def _audio_events(pcm: AsyncIterator[torch.Tensor]) -> AsyncIterator[str]:
    async for p in pcm:
        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(media.pcm_bytes(p)).decode()})
    yield sse({"type": "speech.audio.done"})
