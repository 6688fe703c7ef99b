"""``mstar bench realtime``: time from the end of a spoken turn to the first answer delta, over
``WS /v1/realtime`` (the turn streamed in real time, each completed clip prefilled while it is
spoken), against the same turn sent as one streamed chat completion when the audio ends.

Per level, ``sessions`` clients run at once. Each streams a ``turn_s`` tone (pcm16, 24 kHz) in 20 ms
appends at real-time pace, then commits and asks for a text answer (greedy, ``max_tokens``); the
time is commit -> first ``response.output_text.delta``. The baseline sends the same clips (the
session's ``segment_ms``) as ``input_audio`` parts of a streamed ``/v1/chat/completions`` request
when its audio would have ended: request -> first content delta. Every turn is its own tone, so
no request finds another's clips in the prefix cache. A warm-up sends one turn both ways and
compares the answers (the same greedy text). Reported: p50 / p95 per level and the chat / realtime
ratio of the p50s.

The answers are text: a spoken answer's Talker needs the Thinker's states at every audio
placeholder, which the prefix cache does not keep yet, so its turn is not prefilled while spoken.
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


async def _realtime_turn(ws_url: str, pcm: torch.Tensor, segment_ms: int, max_tokens: int,
                         pace: bool = True) -> tuple[float, str]:
    from websockets.asyncio.client import connect

    async with connect(ws_url, max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": {
            "output_modalities": ["text"], "temperature": 0.0, "max_output_tokens": max_tokens,
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
        first, text = None, []
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "response.output_text.delta":
                first = first or time.perf_counter()
                text.append(event["delta"])
            elif event["type"] == "error":
                raise RuntimeError(f"realtime error: {event['error']['message']}")
            elif event["type"] == "response.done":
                break
    return (first or time.perf_counter()) - t0, "".join(text)


async def _chat_turn(base: str, model: str, pcm: torch.Tensor, segment_ms: int, max_tokens: int,
                     pace: bool = True) -> tuple[float, str]:
    if pace:
        await asyncio.sleep(pcm.numel() / RATE)  # the audio ends, then the request is sent
    parts = [{"type": "input_audio", "input_audio": {"data": _wav(c), "format": "wav"}} for c in _clips(pcm, segment_ms)]
    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        first, text = None, []
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                delta = choices[0].get("delta", {}).get("content") if choices else None
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    return (first or time.perf_counter()) - t0, "".join(text)


def _ws_url(base: str, model: str) -> str:
    return base.replace("http://", "ws://") + f"/v1/realtime?model={model}"


async def _level(base: str, model: str, sessions: int, turn_s: float, segment_ms: int, max_tokens: int,
                 repeat: int, pace: bool) -> Level:
    # every turn its own tone: no request reuses another's clips from the prefix cache
    def tone(i: int, system: int) -> torch.Tensor:
        return _tone(turn_s, 200 + 17 * i + 5 * system + 400 * repeat)

    rt = await asyncio.gather(*(_realtime_turn(_ws_url(base, model), tone(i, 0), segment_ms, max_tokens, pace)
                                for i in range(sessions)))
    chat = await asyncio.gather(*(_chat_turn(base, model, tone(i, 1), segment_ms, max_tokens, pace)
                                  for i in range(sessions)))
    return Level(sessions, [1e3 * t for t, _ in rt], [1e3 * t for t, _ in chat])


async def _warm_up(base: str, model: str, turn_s: float, segment_ms: int, max_tokens: int, pace: bool) -> bool:
    """One turn both ways (the same tone: the chat reuses the realtime turn's blocks, which is why it is
    not timed): whether the answers are the same."""
    pcm = _tone(min(turn_s, 1.0), 150)
    (_, a), (_, b) = await _realtime_turn(_ws_url(base, model), pcm, segment_ms, max_tokens, pace), \
        await _chat_turn(base, model, pcm, segment_ms, max_tokens, pace)
    return a == b


def run_realtime_bench(model: str = "qwen3-omni-tiny", sessions: tuple[int, ...] = (1, 4, 16), turn_s: float = 4.0,
                       segment_ms: int = 1000, max_tokens: int = 8, repeats: int = 1,
                       log: Callable[[str], None] = lambda _: None, pace: bool = True) -> RealtimeResult:
    """``pace``: stream the audio at real-time pace (False, for tests: as fast as it goes)."""
    from mstar.bench.soak_bench import serving

    levels = []
    with serving(model, model) as (base, _):
        same = asyncio.run(_warm_up(base, model, turn_s, segment_ms, max_tokens, pace))
        for n in sessions:
            merged = Level(n)
            for r in range(repeats):
                lv = asyncio.run(_level(base, model, n, turn_s, segment_ms, max_tokens, r, pace))
                merged.realtime_ms += lv.realtime_ms
                merged.chat_ms += lv.chat_ms
                log(f"{n} sessions, repeat {r + 1}/{repeats}: realtime p50 {percentile(lv.realtime_ms, 50):.0f} ms, "
                    f"chat p50 {percentile(lv.chat_ms, 50):.0f} ms")
            levels.append(merged)
    return RealtimeResult(model, turn_s, segment_ms, max_tokens, levels, same)


def format_table(res: RealtimeResult) -> str:
    lines = [f"Model: {res.model}; a {res.turn_s:g} s turn streamed in 20 ms appends at real-time pace, clips of "
             f"{res.segment_ms} ms, text answers of {res.max_tokens} tokens (greedy). Realtime: commit -> first "
             "response.output_text.delta; chat: the same clips as one streamed chat completion sent when the audio "
             f"ends -> first content delta. Every turn its own tone. Warm-up turn answered alike both ways: "
             f"{'yes' if res.same_answer else 'NO'}.", "",
             "| sessions | realtime p50 ms | realtime p95 ms | chat p50 ms | chat p95 ms | chat / realtime (p50) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for lv in res.levels:
        rt50, rt95 = percentile(lv.realtime_ms, 50), percentile(lv.realtime_ms, 95)
        ch50, ch95 = percentile(lv.chat_ms, 50), percentile(lv.chat_ms, 95)
        lines.append(f"| {lv.sessions} | {rt50:.0f} | {rt95:.0f} | {ch50:.0f} | {ch95:.0f} | {ch50 / rt50:.2f} |")
    return "\n".join(lines)
