"""Orpheus TTS serving benchmark: ``mstar bench orpheus``.

The systems below generate speech for the same C requests (different short texts, ``prompt_ids``
format), with the same weights: an ``OrpheusTiny`` (dummy weights, scaled up so a step is real work)
whose LLM weights are copied into a ``transformers.LlamaForCausalLM``, and its SNAC codec.

* ``mstar``: an ``mstar.Runtime`` (inline by default); the C requests are submitted at once and their
  streamed items are timed as they arrive. TTFA = first non-empty ``audio`` item - submit; end = the
  request's end of stream. Audio is streamed by the reference rule (frames 1..N-3 of N, see
  ``mstar/models/orpheus/codec.py``).
* ``hf-sequential``: the plain script without a server: per request, HF ``generate`` and then ONE SNAC
  decode of all its whole frames. Requests queue one after another, all submitted at t0: request k's
  TTFA (= its end) includes the k-1 before it.
* ``hf-static-batch``: one HF ``generate`` over the C left-padded prompts, then one SNAC decode per
  request. Nobody hears anything before everything is done: TTFA = end = total time.
* ``vllm-snac`` (``mstar bench compare tts``, needs ``make bench-peers``): the way orpheus-tts serves
  the model -- the same LLM weights (saved by transformers) in vLLM's CPU engine, in its own
  virtualenv and process, all C requests added at once; this process takes each engine step's tokens
  as they arrive and runs orpheus-tts's client-side decoder on them: per request, each time its count
  of audio tokens reaches a multiple of 7 that is >= 28, one SNAC decode of its last 28 tokens and
  samples ``[S, 2S)`` out (the streaming rule mstar follows; no batching across requests, as there).
  TTFA = the first such audio - the submission. Its sampling is the same constrained sampling
  (``peers/vllm_audio_codes.py``, a vLLM logits processor), with vLLM's own seed.

Every request generates exactly ``tokens`` new tokens on every system (EOS ignored), with the
Orpheus sampling defaults (temperature 0.6, top_p 0.8, repetition_penalty 1.3, no top-k; or, with
``sampler="temperature"``, temperature 0.6 alone) and the same constrained audio decoding (only the
stop token and the 4096 audio tokens valid at SNAC position ``i % 7`` of the i-th generated token may
be sampled), so all produce valid codes. The HF and vLLM systems compute the whole head and mask its
logits before their full-vocabulary samplers. mstar samples among the 4,097 candidates' logits,
which it computes alone (``head="candidates"``, the default here) or takes from the whole head
(``head="full"``, what ``compare tts`` runs: every system then does the head arithmetic of a
real, unconstrained checkpoint; the samplers still differ). Sampling seeds differ between the
systems: the tokens are not the same, only their number.

Audio seconds are those each system produces (int16 samples / 24000): the streaming rule emits N-3
frames where the baselines decode all N. Throughput = total audio s / wall s of the batch;
RTF of a request = (end - submit) / its audio s. With the tiny SNAC (16 samples per frame instead of
2048) the absolute audio seconds are tiny; the ratios between systems are what the benchmark is for.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.bench import harness
from mstar.bench.orpheus_systems import (
    SAMPLERS,
    SystemRun,
    run_hf_sequential,
    run_hf_static,
    run_mstar,
    run_vllm_snac,
    start_vllm,
)
from mstar.bench.stats import percentile
from mstar.models.orpheus.codec import TOKENS_PER_FRAME
from mstar.models.orpheus.config import VOICES
from mstar.models.orpheus.loader import samples_per_frame
from mstar.models.orpheus.model import OrpheusTiny
from mstar.runtime.api import Runtime

SYSTEMS = ("mstar", "hf-sequential", "hf-static-batch")
VLLM = "vllm-snac"
HF_SYSTEMS = ("hf-sequential", "hf-static-batch")
HEADS = ("candidates", "full")
TEXTS = (
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Please leave a message after the tone.",
    "It is going to rain this afternoon <sigh>.",
    "Welcome back! Your order has shipped.",
    "Turn left at the next intersection.",
    "I can't believe it actually worked <laugh>.",
    "Thank you for calling, goodbye.",
)


def request_texts(n: int) -> list[tuple[str, str]]:
    """``n`` different short (text, voice) pairs."""
    return [(f"{TEXTS[i % len(TEXTS)]} Number {i}.", VOICES[i % len(VOICES)]) for i in range(n)]


# -- measurements -----------------------------------------------------------------------------------
@dataclass
class SystemSummary:
    system: str
    concurrency: int
    throughput: float  # audio s per wall s (median over repeats)
    ttfa_p50_ms: float
    ttfa_p95_ms: float
    rtf_p50: float
    wall_s: float  # median over repeats
    audio_s_per_request: float  # mean
    tokens_per_request: float  # mean
    raw: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, system: str, concurrency: int, runs: list[SystemRun]) -> SystemSummary:
        reqs = [r for run in runs for r in run.requests]
        ttfa = [r.ttfa_s * 1e3 for r in reqs]
        return cls(system, concurrency,
                   throughput=statistics.median(run.audio_s / run.wall_s for run in runs),
                   ttfa_p50_ms=percentile(ttfa, 50), ttfa_p95_ms=percentile(ttfa, 95),
                   rtf_p50=percentile([r.rtf for r in reqs], 50),
                   wall_s=statistics.median(run.wall_s for run in runs),
                   audio_s_per_request=statistics.fmean(r.audio_s for r in reqs),
                   tokens_per_request=statistics.fmean(r.tokens for r in reqs),
                   raw={"wall_s": [run.wall_s for run in runs], "ttfa_ms": ttfa,
                        "end_ms": [r.end_s * 1e3 for r in reqs]})


@dataclass
class ConcurrencyResult:
    concurrency: int
    systems: dict[str, SystemSummary]
    throughput_ratio: dict[str, float]  # ours / baseline
    ttfa_ratio: dict[str, float]  # baseline p50 / ours p50
    goal_throughput_3x: bool  # vs the better HF baseline
    goal_ttfa_5x: bool  # vs the HF baseline with the lower TTFA
    goal_vllm: bool | None = None  # >= 1.2x vllm-snac's throughput and a lower TTFA p50 (None: not run)


@dataclass
class OrpheusBenchResult:
    tokens: int
    repeats: int
    hidden: int
    layers: int
    head_dim: int
    workers: str
    threads: int
    samples_per_frame: int
    results: list[ConcurrencyResult]
    sampler: str = "orpheus"
    head: str = "candidates"
    vllm_version: str | None = None
    vllm_skipped: str | None = None


# -- the shared model ---------------------------------------------------------------------------------
def build_models(hidden: int, layers: int, head_dim: int, seed: int = 0, head: str = "candidates"):
    """``(orpheus_model, hf_llama, snac)``: the HF model holds exactly our LLM node's weights.
    ``head``: mstar's constrained sampling computes the 4,097 candidate logits alone (``candidates``)
    or the whole head and takes them from it (``full``: the head arithmetic of the other systems and
    of an unconstrained checkpoint)."""
    import transformers

    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; known: {', '.join(HEADS)}")
    model = OrpheusTiny(hidden_size=hidden, num_layers=layers, head_dim=head_dim, seed=seed,
                        candidate_logits=head == "candidates")
    mods = model.build_submodules(["LLM", "snac_decoder"])
    ours = mods["LLM"]
    hf_cfg = transformers.LlamaConfig(**model.llm_config.to_hf_dict())
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = ours.state_dict()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("rotary_emb.inv_freq") for k in missing):
        raise RuntimeError(f"weight copy into LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf_state = hf.state_dict()
    for name, t in state.items():
        if not torch.equal(hf_state[name], t):
            raise RuntimeError(f"weight {name} differs after the copy")
    if hf_cfg.tie_word_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("LlamaForCausalLM's lm_head is not tied to its embedding")
    hf.generation_config.eos_token_id = None  # ignore EOS: exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return model, hf, mods["snac_decoder"].snac, ours


def _state_digest(module: torch.nn.Module) -> list[float]:
    with torch.no_grad():
        return [float(p.double().sum()) for p in module.parameters()]


# -- driver ---------------------------------------------------------------------------------------------
def _check(system: str, run: SystemRun, tokens: int) -> SystemRun:
    bad = [r.tokens for r in run.requests if r.tokens != tokens]
    if bad:
        raise RuntimeError(f"{system}: requests generated {bad} tokens, expected {tokens} each")
    if not all(r.audio_samples > 0 for r in run.requests):
        raise RuntimeError(f"{system}: a request produced no audio (tokens={tokens}: too few frames?)")
    return run


def run_orpheus_bench(concurrency: list[int], tokens: int = 140, repeats: int = 1, hidden: int = 256,
                      layers: int = 4, head_dim: int = 64, workers: str = "inline", warmup: bool = True,
                      seed: int = 0, log: Callable[[str], None] | None = None,
                      systems: Sequence[str] = SYSTEMS, peer_venv: str | None = None,
                      sampler: str = "orpheus", head: str = "candidates") -> OrpheusBenchResult:
    """Every system of ``systems`` (``SYSTEMS``, plus ``VLLM`` for the vLLM anchor; mstar and both HF
    baselines always run) at every concurrency, in turn, ``repeats`` times."""
    from mstar.bench.llm_systems import PeerUnavailable

    if not concurrency or min(concurrency) < 1 or repeats < 1:
        raise ValueError("every concurrency and repeats must be >= 1")
    if tokens < 4 * TOKENS_PER_FRAME:
        raise ValueError(f"tokens must be >= {4 * TOKENS_PER_FRAME} (4 frames) for the stream to emit audio")
    unknown = set(systems) - {*SYSTEMS, VLLM}
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {', '.join((*SYSTEMS, VLLM))}")
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
    sp = SAMPLERS[sampler]
    order = [*SYSTEMS, *([VLLM] if VLLM in systems else [])]
    say = log or (lambda _msg: None)
    model, hf, snac_model, ours = build_models(hidden, layers, head_dim, seed, head)
    spf = samples_per_frame(snac_model)
    results = []
    peer, vllm_version, vllm_skipped = None, None, None
    with tempfile.TemporaryDirectory(prefix="mstar-orpheus-bench-") as tmp, Runtime(model, workers=workers) as rt:
        if workers == "inline":  # the runtime built its own modules: make sure they are the same weights
            served = rt.local_module("LLM")
            if _state_digest(served) != _state_digest(ours):
                raise RuntimeError("the runtime's LLM weights differ from the baseline's")
        del ours
        if VLLM in order:
            every = [model.prompt_ids(t, v) for t, v in request_texts(max(concurrency))]
            try:
                peer = start_vllm(hf, every, tokens, max(concurrency), Path(tmp), peer_venv, say)
                vllm_version = peer.version
            except PeerUnavailable as e:
                vllm_skipped = str(e)
                say(vllm_skipped)
                order.remove(VLLM)
        try:
            warm = [model.prompt_ids(t, v) for t, v in request_texts(2)]
            wt = min(tokens, 5 * TOKENS_PER_FRAME)

            def one(system: str, batch: list[list[int]], n: int, s0: int) -> SystemRun:
                if peer is not None and system != VLLM:
                    peer.suspend()  # idle, vLLM keeps a core busy (llm_systems.VllmSystem.suspend)
                if system == "mstar":
                    return run_mstar(rt, batch, n, s0, sp)
                if system == "hf-sequential":
                    return run_hf_sequential(hf, snac_model, batch, n, s0 + 500, spf, sp)
                if system == "hf-static-batch":
                    return run_hf_static(hf, snac_model, batch, n, s0 + 500, spf, sp)
                return run_vllm_snac(peer, snac_model, batch, n, spf, sp)

            for i, c in enumerate(concurrency):
                prompts = [model.prompt_ids(t, v) for t, v in request_texts(c)]
                # the harness rotates the systems' order per repeat; one warm-up of each before the first level
                runs = harness.rotate(
                    order, lambda s, r, p=prompts: _check(s, one(s, p, tokens, seed + 1000 * (r + 1)), tokens),
                    repeats, warmup=lambda s: one(s, warm[:1] if s == "hf-sequential" else warm, wt, seed),
                    warm=warmup and i == 0,
                    log=lambda msg, c=c: say(f"concurrency {c} {msg}"), label=lambda run: f"wall {run.wall_s:.2f} s")
                results.append(_compare(c, {s: SystemSummary.of(s, c, r) for s, r in runs.items()}))
        finally:
            if peer is not None:
                peer.close()
    return OrpheusBenchResult(tokens, repeats, hidden, layers, head_dim, workers, torch.get_num_threads(), spf,
                              results, sampler, head, vllm_version, vllm_skipped)


def _compare(c: int, summ: dict[str, SystemSummary]) -> ConcurrencyResult:
    mine = summ["mstar"]
    tput = {s: mine.throughput / v.throughput for s, v in summ.items() if s != "mstar"}
    ttfa = {s: v.ttfa_p50_ms / mine.ttfa_p50_ms for s, v in summ.items() if s != "mstar"}
    goal_vllm = tput[VLLM] >= 1.2 and ttfa[VLLM] > 1.0 if VLLM in summ else None
    return ConcurrencyResult(c, summ, tput, ttfa, goal_throughput_3x=min(tput[s] for s in HF_SYSTEMS) >= 3.0,
                             goal_ttfa_5x=min(ttfa[s] for s in HF_SYSTEMS) >= 5.0, goal_vllm=goal_vllm)


def to_json(res: OrpheusBenchResult) -> dict[str, Any]:
    return asdict(res)


def format_table(res: OrpheusBenchResult) -> str:
    lines = [f"tokens={res.tokens} repeats={res.repeats} hidden={res.hidden} layers={res.layers} "
             f"head_dim={res.head_dim} workers={res.workers} torch_threads={res.threads} "
             f"SNAC samples/frame={res.samples_per_frame} mstar head={res.head} sampler={res.sampler} "
             f"{SAMPLERS[res.sampler]}"
             + (f" vLLM={res.vllm_version}" if res.vllm_version else "")]
    for r in res.results:
        lines += [
            "",
            f"concurrency {r.concurrency}:",
            "",
            "| system | audio-s per wall-s | TTFA p50 ms | TTFA p95 ms | RTF p50 | wall s | audio s/request "
            "| ours/this throughput | this/ours TTFA p50 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, s in r.systems.items():
            tput = f"{r.throughput_ratio[name]:.2f}x" if name in r.throughput_ratio else "—"
            ttfa = f"{r.ttfa_ratio[name]:.2f}x" if name in r.ttfa_ratio else "—"
            lines.append(f"| {name} | {s.throughput:.5f} | {s.ttfa_p50_ms:.0f} | {s.ttfa_p95_ms:.0f} | "
                         f"{s.rtf_p50:.0f} | {s.wall_s:.2f} | {s.audio_s_per_request:.4f} | {tput} | {ttfa} |")
        lines.append("")
        hf_tput = min(r.throughput_ratio[s] for s in HF_SYSTEMS)
        hf_ttfa = min(r.ttfa_ratio[s] for s in HF_SYSTEMS)
        lines.append(f"goals: throughput >= 3x the better HF baseline: {'met' if r.goal_throughput_3x else 'NOT met'} "
                     f"({hf_tput:.2f}x); TTFA >= 5x lower than the HF baselines: "
                     f"{'met' if r.goal_ttfa_5x else 'NOT met'} ({hf_ttfa:.2f}x)")
        if r.goal_vllm is not None:
            lines.append(f"vs {VLLM}: throughput >= 1.2x and a lower TTFA: {'met' if r.goal_vllm else 'NOT met'} "
                         f"({r.throughput_ratio[VLLM]:.2f}x throughput, TTFA {r.ttfa_ratio[VLLM]:.2f}x lower)")
    if res.vllm_skipped:
        lines.append(res.vllm_skipped)
    return "\n".join(lines)
