"""``mstar bench realtime``: time from the end of a spoken turn to the first answer delta, over
``WS /v1/realtime`` (the turn streamed in real time, each completed clip prefilled while it is
spoken), against the same turn sent as one streamed chat completion when the audio ends.

Per level, ``sessions`` clients run at once. Each streams a ``turn_s`` tone (pcm16, 24 kHz) in 20 ms
appends at real-time pace, then commits and asks for an answer (greedy, ``max_tokens``; ``output``
"audio": spoken, its Talker greedy and bounded by ``max_tokens`` too, or "text"); the time is
commit -> the first ``response.output_audio.delta`` (``response.output_text.delta``). The baseline
sends the same clips (the session's ``segment_ms``) as ``input_audio`` parts of a streamed
``/v1/chat/completions`` request when its audio would have ended: request -> the first audio
(content) delta. Every turn is its own tone, so no request finds another's clips in the prefix
cache. A warm-up sends one turn both ways and compares the answers (the same greedy text, or the
same pcm). Reported: p50 / p95 per level and the chat / realtime ratio of the p50s.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import torch

from mstar.bench.stats import percentile

__all__ = ["RealtimeResult", "format_table", "run_realtime_bench"]

RATE = 24_000
CHUNK = RATE // 50  # 20 ms


@dataclass
class Level:
    sessions: int
    realtime_ms: list[float] = field(default_factory=list)
    chat_ms: list[float] = field(default_factory=list)


@dataclass
class RealtimeResult:
    model: str
    turn_s: float
    segment_ms: int
    max_tokens: int
    output: str  # "audio" or "text"
    levels: list[Level]
    same_answer: bool  # the warm-up turn: realtime and chat answered alike


def _tone(seconds: float, freq: float) -> torch.Tensor:
    t = torch.arange(int(seconds * RATE)) / RATE
    return (0.3 * torch.sin(2 * math.pi * freq * t) * 32767).to(torch.int16)


def _wav(pcm: torch.Tensor) -> str:
    f = io.BytesIO()
    with wave.open(f, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.numpy().tobytes())
    return base64.b64encode(f.getvalue()).decode()


def _clips(pcm: torch.Tensor, segment_ms: int) -> list[torch.Tensor]:
    """The session's clips of a turn (``RealtimeSession._turn_clips``: a last clip under 100 ms joins the one before)."""
    step = segment_ms * RATE // 1000
    clips = list(pcm.split(step))
    if len(clips) > 1 and clips[-1].numel() < RATE // 10:
        clips[-2:] = [torch.cat(clips[-2:])]
    return clips


_DELTA = {"text": "response.output_text.delta", "audio": "response.output_audio.delta"}


async def _realtime_turn(ws_url: str, pcm: torch.Tensor, segment_ms: int, max_tokens: int, output: str,
                         pace: bool = True) -> tuple[float, str]:
    """(commit -> first answer delta, the answer: its text, or its pcm as base64 pieces)."""
    from websockets.asyncio.client import connect

    async with connect(ws_url, max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": {
            "output_modalities": [output], "temperature": 0.0, "max_output_tokens": max_tokens,
            "input_audio_segment_ms": segment_ms, "audio": {"input": {"turn_detection": None}}}}))
        start = time.perf_counter()
        for i, chunk in enumerate(pcm.split(CHUNK)):  # at real-time pace
            if pace:
                await asyncio.sleep(max(0.0, start + i * 0.02 - time.perf_counter()))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(chunk.numpy().tobytes()).decode()}))
        if pace:
            await asyncio.sleep(max(0.0, start + pcm.numel() / RATE - time.perf_counter()))
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        first, answer = None, []
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == _DELTA[output]:
                first = first or time.perf_counter()
                answer.append(event["delta"] if output == "text" else base64.b64decode(event["delta"]).hex())
            elif event["type"] == "error":
                raise RuntimeError(f"realtime error: {event['error']['message']}")
            elif event["type"] == "response.done":
                break
    return (first or time.perf_counter()) - t0, "".join(answer)


async def _chat_turn(base: str, model: str, pcm: torch.Tensor, segment_ms: int, max_tokens: int, output: str,
                     pace: bool = True) -> tuple[float, str]:
    if pace:
        await asyncio.sleep(pcm.numel() / RATE)  # the audio ends, then the request is sent
    parts = [{"type": "input_audio", "input_audio": {"data": _wav(c), "format": "wav"}} for c in _clips(pcm, segment_ms)]
    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    if output == "audio":  # the realtime session's spoken answer: greedy, its Talker bounded by max_tokens
        body.update(modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                    talker_temperature=0.0, talker_max_tokens=max_tokens)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        first, answer = None, []
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                delta = choices[0].get("delta", {}) if choices else {}
                if output == "text" and delta.get("content"):
                    piece = delta["content"]
                elif output == "audio" and (delta.get("audio") or {}).get("data"):
                    piece = base64.b64decode(delta["audio"]["data"]).hex()
                else:
                    continue
                first = first or time.perf_counter()
                answer.append(piece)
    return (first or time.perf_counter()) - t0, "".join(answer)


def _ws_url(base: str, model: str) -> str:
    return base.replace("http://", "ws://") + f"/v1/realtime?model={model}"


async def _level(base: str, model: str, sessions: int, turn_s: float, segment_ms: int, max_tokens: int,
                 output: str, repeat: int, pace: bool) -> Level:
    # every turn its own tone: no request reuses another's clips from the prefix cache
    def tone(i: int, system: int) -> torch.Tensor:
        return _tone(turn_s, 200 + 17 * i + 5 * system + 400 * repeat)

    rt = await asyncio.gather(*(_realtime_turn(_ws_url(base, model), tone(i, 0), segment_ms, max_tokens, output,
                                               pace) for i in range(sessions)))
    chat = await asyncio.gather(*(_chat_turn(base, model, tone(i, 1), segment_ms, max_tokens, output, pace)
                                  for i in range(sessions)))
    return Level(sessions, [1e3 * t for t, _ in rt], [1e3 * t for t, _ in chat])


async def _warm_up(base: str, model: str, turn_s: float, segment_ms: int, max_tokens: int, output: str,
                   pace: bool) -> bool:
    """One turn both ways, the chat completion first (the realtime turn reuses its blocks, which is why
    it is not timed): whether the answers are the same."""
    pcm = _tone(min(turn_s, 1.0), 150)
    _, b = await _chat_turn(base, model, pcm, segment_ms, max_tokens, output, pace)
    _, a = await _realtime_turn(_ws_url(base, model), pcm, segment_ms, max_tokens, output, pace)
    return a == b and bool(a)


def run_realtime_bench(model: str = "qwen3-omni-tiny", sessions: tuple[int, ...] = (1, 4, 16), turn_s: float = 4.0,
                       segment_ms: int = 1000, max_tokens: int = 8, repeats: int = 1,
                       log: Callable[[str], None] = lambda _: None, pace: bool = True,
                       output: str = "audio") -> RealtimeResult:
    """``pace``: stream the audio at real-time pace (False, for tests: as fast as it goes); ``output``:
    "audio" (spoken answers) or "text"."""
    if output not in _DELTA:
        raise ValueError(f"output must be one of {sorted(_DELTA)}")
    from mstar.bench.soak_bench import serving

    levels = []
    with serving(model, model) as (base, _):
        same = asyncio.run(_warm_up(base, model, turn_s, segment_ms, max_tokens, output, pace))
        for n in sessions:
            merged = Level(n)
            for r in range(repeats):
                lv = asyncio.run(_level(base, model, n, turn_s, segment_ms, max_tokens, output, r, pace))
                merged.realtime_ms += lv.realtime_ms
                merged.chat_ms += lv.chat_ms
                log(f"{n} sessions, repeat {r + 1}/{repeats}: realtime p50 {percentile(lv.realtime_ms, 50):.0f} ms, "
                    f"chat p50 {percentile(lv.chat_ms, 50):.0f} ms")
            levels.append(merged)
    return RealtimeResult(model, turn_s, segment_ms, max_tokens, output, levels, same)


def format_table(res: RealtimeResult) -> str:
    spoken = res.output == "audio"
    answers = (f"spoken answers (greedy; at most {res.max_tokens} text tokens and {res.max_tokens} Talker steps)"
               if spoken else f"text answers of {res.max_tokens} tokens (greedy)")
    lines = [f"Model: {res.model}; a {res.turn_s:g} s turn streamed in 20 ms appends at real-time pace, clips of "
             f"{res.segment_ms} ms, {answers}. Realtime: commit -> first {_DELTA[res.output]}; chat: the same clips "
             f"as one streamed chat completion sent when the audio ends -> first {'audio' if spoken else 'content'} "
             f"delta. Every turn its own tone. Warm-up turn answered alike both ways: "
             f"{'yes' if res.same_answer else 'NO'}.", "",
             "| sessions | realtime p50 ms | realtime p95 ms | chat p50 ms | chat p95 ms | chat / realtime (p50) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for lv in res.levels:
        rt50, rt95 = percentile(lv.realtime_ms, 50), percentile(lv.realtime_ms, 95)
        ch50, ch95 = percentile(lv.chat_ms, 50), percentile(lv.chat_ms, 95)
        lines.append(f"| {lv.sessions} | {rt50:.0f} | {rt95:.0f} | {ch50:.0f} | {ch95:.0f} | {ch50 / rt50:.2f} |")
    return "\n".join(lines)
