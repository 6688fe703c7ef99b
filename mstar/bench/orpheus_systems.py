"""The systems of ``mstar bench orpheus`` / ``compare tts`` (see ``orpheus_bench.py`` for the
workload and what each is): mstar (an inline ``Runtime``), HF ``generate`` one request at a time and
as one static batch, and vLLM's CPU engine with orpheus-tts's client-side SNAC decoding. Each
``run_*`` returns a ``SystemRun`` of per-request ``RequestTiming``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.bench.stats import AudioClock, AudioRun, AudioTiming
from mstar.models.orpheus.codec import (
    AUDIO_TOKEN_BASE,
    CODE_SIZE,
    TOKENS_PER_FRAME,
    WINDOW_TOKENS,
    to_pcm16,
    tokens_to_codes,
)
from mstar.models.orpheus.config import DEFAULT_SAMPLING, STOP_TOKEN
from mstar.runtime.api import Runtime

SAMPLING = {k: DEFAULT_SAMPLING[k] for k in ("temperature", "top_p", "repetition_penalty")}
# ``sampler`` of the benchmark: Orpheus's defaults, or temperature alone (no top-p, no repetition
# penalty: what is left of a step when the sampler's full-vocabulary passes are taken away)
SAMPLERS: dict[str, dict[str, float]] = {"orpheus": SAMPLING,
                                         "temperature": {"temperature": SAMPLING["temperature"], "top_p": 1.0,
                                                         "repetition_penalty": 1.0}}


@dataclass
class RequestTiming(AudioTiming):
    tokens: int


SystemRun = AudioRun


# -- mstar --------------------------------------------------------------------------------------------
def _params(tokens: int, seed: int, sampling: dict[str, float]) -> dict[str, Any]:
    return {"max_tokens": tokens, "sampling": {**sampling, "ignore_eos": True, "seed": seed}}


def run_mstar(rt: Runtime, prompts: list[list[int]], tokens: int, seed: int,
              sampling: dict[str, float] = SAMPLING) -> SystemRun:
    """Submit every request at once (one scheduling step), time the streamed items of each."""

    async def consume(handle, submitted: float) -> RequestTiming:
        clock, ntok = AudioClock(submitted), 0
        async for item in handle:
            if item.name == "audio":
                clock.add(item.value)
            elif item.name == "token":
                ntok += sum(int(v.numel()) for v in item.value)
        return RequestTiming(*clock.times(), clock.samples, ntok)

    async def main() -> SystemRun:
        with rt.held():  # the C submissions start in the same step
            t0 = time.perf_counter()
            subs = []
            for i, p in enumerate(prompts):
                subs.append((rt.submit({"input_ids": torch.tensor(p)}, _params(tokens, seed + i, sampling)),
                             time.perf_counter()))
        reqs = await asyncio.gather(*(consume(h, s) for h, s in subs))
        return SystemRun(time.perf_counter() - t0, list(reqs))

    return asyncio.run(main())


# -- HF baselines ---------------------------------------------------------------------------------------
def audio_constraint(prompt_len: int):
    """A HF ``LogitsProcessor``: the constraint of ``OrpheusLM.sample_next`` (generated token i may
    only be the stop token or an audio token of SNAC position i % 7)."""
    from transformers import LogitsProcessor

    class AudioConstraint(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            step = input_ids.shape[1] - prompt_len
            lo = AUDIO_TOKEN_BASE + (step % TOKENS_PER_FRAME) * CODE_SIZE
            mask = torch.full_like(scores, float("-inf"))
            mask[:, lo:lo + CODE_SIZE] = 0.0
            mask[:, STOP_TOKEN] = 0.0
            return scores + mask

    return AudioConstraint()


def hf_generate(hf, prompts: list[list[int]], tokens: int, seed: int,
                sampling: dict[str, float] = SAMPLING) -> list[list[int]]:
    """One ``generate`` over the (left-padded) prompts; the ``tokens`` new tokens of each."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=tokens,
                          min_new_tokens=tokens, logits_processor=LogitsProcessorList([audio_constraint(width)]),
                          **sampling)
    return out[:, width:].tolist()


def decode_all(snac_model, generated: list[int], samples_per_frame: int) -> torch.Tensor:
    """All whole frames of the request's audio tokens, decoded at once -> int16 PCM (silence for a
    request whose codes are invalid, which only a sampled stop token mid-stream can cause)."""
    audio = [t for t in generated if t >= AUDIO_TOKEN_BASE]
    frames = len(audio) // TOKENS_PER_FRAME
    if frames == 0:
        return torch.zeros(0, dtype=torch.int16)
    codes, valid = tokens_to_codes(audio[:frames * TOKENS_PER_FRAME], 0)
    if not valid:
        return torch.zeros(frames * samples_per_frame, dtype=torch.int16)
    with torch.inference_mode():
        return to_pcm16(snac_model.decode(codes)[0, 0])


def run_hf_sequential(hf, snac_model, prompts: list[list[int]], tokens: int, seed: int,
                      samples_per_frame: int, sampling: dict[str, float] = SAMPLING) -> SystemRun:
    t0 = time.perf_counter()
    reqs = []
    for i, p in enumerate(prompts):
        [gen] = hf_generate(hf, [p], tokens, seed + i, sampling)
        pcm = decode_all(snac_model, gen, samples_per_frame)
        done = time.perf_counter() - t0
        reqs.append(RequestTiming(done, done, int(pcm.numel()), len(gen)))
    return SystemRun(time.perf_counter() - t0, reqs)


def run_hf_static(hf, snac_model, prompts: list[list[int]], tokens: int, seed: int,
                  samples_per_frame: int, sampling: dict[str, float] = SAMPLING) -> SystemRun:
    t0 = time.perf_counter()
    gens = hf_generate(hf, prompts, tokens, seed, sampling)
    pcms = [decode_all(snac_model, g, samples_per_frame) for g in gens]
    wall = time.perf_counter() - t0
    return SystemRun(wall, [RequestTiming(wall, wall, int(pcm.numel()), len(g)) for pcm, g in zip(pcms, gens)])


# -- vLLM + SNAC, as orpheus-tts serves it ---------------------------------------------------------------
class WindowDecoder:
    """orpheus-tts's client-side decoder for one request: audio tokens in, PCM out every 7 tokens
    from the 28th (one SNAC decode of the last 4 frames, their second frame's samples kept)."""

    def __init__(self, snac_model, samples_per_frame: int) -> None:
        self.snac, self.spf = snac_model, samples_per_frame
        self.audio: list[int] = []
        self.tokens = 0

    def push(self, token: int) -> torch.Tensor | None:
        self.tokens += 1
        if token < AUDIO_TOKEN_BASE:  # the reference skips what is not an audio token
            return None
        self.audio.append(token)
        n = len(self.audio)
        if n % TOKENS_PER_FRAME or n < WINDOW_TOKENS:
            return None
        codes, valid = tokens_to_codes(self.audio[-WINDOW_TOKENS:], n - WINDOW_TOKENS)
        if not valid:  # the reference drops the window
            return None
        with torch.inference_mode():
            return to_pcm16(self.snac.decode(codes)[0, 0, self.spf:2 * self.spf])


def audio_codes_spec() -> dict[str, int]:
    """The peer's ``AudioCodeConstraint`` arguments: the constraint of ``OrpheusLM.sample_next``."""
    return {"base": AUDIO_TOKEN_BASE, "size": CODE_SIZE, "frame": TOKENS_PER_FRAME, "stop": STOP_TOKEN}


def run_vllm_snac(peer, snac_model, prompts: list[list[int]], tokens: int, samples_per_frame: int,
                  sampling: dict[str, float] = SAMPLING) -> SystemRun:
    """The client decodes on one thread: with two, its OpenMP workers spin on the cores vLLM's
    engine is bound to and slow vLLM down, which would charge the client's threading to the peer."""
    decoders = [WindowDecoder(snac_model, samples_per_frame) for _ in prompts]
    first: list[float | None] = [None] * len(prompts)
    end = [0.0] * len(prompts)
    samples = [0] * len(prompts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        for i, ids in peer.stream(prompts, tokens, dict(sampling, top_k=0), audio_codes_spec()):
            for t in ids:
                pcm = decoders[i].push(int(t))
                if pcm is not None and pcm.numel():
                    samples[i] += int(pcm.numel())
                    if first[i] is None:
                        first[i] = time.perf_counter() - t0
            end[i] = time.perf_counter() - t0
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return SystemRun(wall, [RequestTiming(f if f is not None else e, e, n, d.tokens)
                            for f, e, n, d in zip(first, end, samples, decoders)])


def start_vllm(hf, prompts: list[list[int]], tokens: int, max_seqs: int, workdir: Path, venv: str | None,
               say: Callable[[str], None]):
    """The HF model saved to ``workdir`` and served by the vLLM peer (PeerUnavailable if it can't be)."""
    from mstar.bench.llm_systems import VllmSystem

    ckpt = workdir / "orpheus-llm"
    hf.save_pretrained(ckpt, safe_serialization=True)
    say("starting vLLM CPU (its startup takes a minute or two)")
    return VllmSystem(ckpt, venv, max_prompt_len=max(len(p) for p in prompts), max_tokens=tokens,
                      max_num_seqs=max_seqs, log=say, audio_constraint=True)
