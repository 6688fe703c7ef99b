"""Qwen3-Omni text-to-speech benchmark: ``mstar bench compare omni``.

One random Qwen3-Omni (a configuration somewhat larger than ``qwen3-omni-tiny``, :func:`bench_hf_config`)
is built by transformers with a seed and saved with ``save_pretrained``; mstar loads that directory
with its own loader (``qwen3-omni --model-path DIR``), so both sides hold the same weights (the fused
expert tensors transformers' init leaves unset are filled from the seed first). Three
systems speak the same C prompts (short sentences in a user turn after the audio-output system prompt,
the chat layout of ``mstar.models.qwen3_omni.prompt``):

* ``mstar``: an inline ``Runtime``; the C requests are submitted in one scheduling step and their
  streamed items are timed as they arrive. TTFA = first non-empty ``audio`` item - submit.
* ``hf-sequential``: ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` one request
  after another, all submitted at t0 (request k waits for the k - 1 before it). It returns audio only
  at its end: TTFA = end.
* ``hf-batched``: one ``generate`` over the C left-padded prompts (as the processor pads): TTFA = end
  = the batch's wall time.

Thinker greedy, ``text_tokens`` at most; talker greedy by default (the reference default is sampled,
temperature 0.9 / top-k 50, ``--sample``), codec EOS suppressed on every system so each request speaks
exactly ``talker_steps - 1`` frames (80 ms each, 1920 samples per frame minus 555 per request). With
greedy decoding the systems must agree: the parity line compares mstar's text tokens, frame codes
and audio length with ``hf-sequential``'s request by request.

Throughput = requests / wall s and audio s / wall s; RTF of a request = (end - submit) / its audio s.
"""

from __future__ import annotations

import asyncio
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.bench import harness
from mstar.bench.stats import AudioClock, AudioRun, AudioTiming, percentile, spread, spread_cell
from mstar.models.llama.tokenizer import ByteTokenizer
from mstar.models.qwen3_omni.config import TINY_HF_CONFIG
from mstar.models.qwen3_omni.prompt import AUDIO_SYSTEM_PROMPT, ChatTurn, OmniTokenIds, chat_token_ids
from mstar.runtime.api import Runtime

SYSTEMS = ("mstar", "hf-sequential", "hf-batched")
BASELINES = SYSTEMS[1:]
VOICE = "ethan"
TEXTS = (
    "Please call Stella and ask her to bring these things with her from the store.",
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It is easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
)
SAMPLED_TALKER = {"temperature": 0.9, "top_k": 50}  # the reference's default (both keep repetition penalty 1.05)


def prompts(n: int) -> list[list[int]]:
    """``n`` TTS prompts: the audio system prompt, one user turn with a sentence, the assistant header
    (byte-level ids: the random model has no tokenizer)."""
    tok, ids = ByteTokenizer(), OmniTokenIds()
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return [chat_token_ids([ChatTurn("user", f"{TEXTS[i % len(TEXTS)]} Number {i}.")], encode, ids,
                           system_prompt=AUDIO_SYSTEM_PROMPT) for i in range(n)]


def bench_hf_config(hidden: int = 128, layers: int = 4, experts: int = 8) -> dict[str, Any]:
    """``qwen3-omni-tiny``'s HF config scaled up: ``hidden`` wide (head_dim 32), ``layers`` thinker and
    talker layers, ``experts`` experts (top-2), a 2-layer code predictor and Code2Wav."""
    cfg = copy.deepcopy(dict(TINY_HF_CONFIG))
    head_dim = 32
    rope = {"mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]}
    moe = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, head_dim=head_dim,
               num_experts=experts, moe_intermediate_size=hidden // 2)
    thinker, talker, c2w = cfg["thinker_config"], cfg["talker_config"], cfg["code2wav_config"]
    thinker["text_config"].update(moe)
    thinker["text_config"]["rope_parameters"].update(rope)
    thinker["audio_config"]["output_dim"] = hidden
    thinker["vision_config"]["out_hidden_size"] = hidden
    talker["text_config"].update(moe, shared_expert_intermediate_size=hidden)
    talker["text_config"]["rope_parameters"].update(rope)
    talker["code_predictor_config"].update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                           head_dim=head_dim)
    talker["thinker_hidden_size"] = hidden
    c2w.update(hidden_size=64, num_hidden_layers=2, intermediate_size=128, decoder_dim=128)
    return cfg


def describe_config(cfg: dict[str, Any]) -> str:
    t, c = cfg["thinker_config"]["text_config"], cfg["talker_config"]["code_predictor_config"]
    w, talker = cfg["code2wav_config"], cfg["talker_config"]["text_config"]
    size = "custom"
    if cfg == dict(TINY_HF_CONFIG):
        size = "the qwen3-omni-tiny config"
    elif t["hidden_size"] > TINY_HF_CONFIG["thinker_config"]["text_config"]["hidden_size"]:
        size = "larger than qwen3-omni-tiny"
    return (f"{size}: hidden {t['hidden_size']}, {t['num_hidden_layers']} thinker + {talker['num_hidden_layers']} talker "
            f"layers, {t['num_experts']} experts top-{t['num_experts_per_tok']}, code predictor "
            f"{c['num_hidden_layers']} layers, Code2Wav {w['num_hidden_layers']} layers / decoder {w['decoder_dim']}")


# -- measurements -----------------------------------------------------------------------------------
@dataclass
class RequestResult(AudioTiming):
    text: list[int] = field(default_factory=list)
    codes: torch.Tensor | None = None  # [frames, 16] where the system exposes them


SystemRun = AudioRun


@dataclass
class SystemSummary:
    system: str
    concurrency: int
    req_per_s: tuple[float, float, float]  # spread over repeats
    audio_s_per_s: tuple[float, float, float]
    ttfa_p50_ms: float  # over every request of every repeat
    ttfa_p95_ms: float
    rtf_p50: float
    audio_s_per_request: float

    @classmethod
    def of(cls, system: str, concurrency: int, runs: list[SystemRun]) -> SystemSummary:
        reqs = [r for run in runs for r in run.requests]
        ttfa = [r.ttfa_s * 1e3 for r in reqs]
        return cls(system, concurrency, spread([len(run.requests) / run.wall_s for run in runs]),
                   spread([run.audio_s / run.wall_s for run in runs]), percentile(ttfa, 50), percentile(ttfa, 95),
                   percentile([r.rtf for r in reqs], 50), statistics.fmean(r.audio_s for r in reqs))


@dataclass
class Parity:
    requests: int
    text_equal: int
    codes_equal: int
    length_equal: int  # mstar's audio length == hf-sequential's == hf-batched's

    @property
    def ok(self) -> bool:
        return self.text_equal == self.codes_equal == self.length_equal == self.requests


@dataclass
class ConcurrencyResult:
    concurrency: int
    systems: dict[str, SystemSummary]
    parity: Parity | None  # greedy runs only

    def better_baseline(self, key: Callable[[SystemSummary], float], low: bool = False) -> SystemSummary:
        base = [self.systems[s] for s in BASELINES]
        return min(base, key=key) if low else max(base, key=key)

    @property
    def throughput_ratio(self) -> float:
        """mstar's requests/s over the better baseline's (medians)."""
        return self.systems["mstar"].req_per_s[0] / self.better_baseline(lambda s: s.req_per_s[0]).req_per_s[0]

    @property
    def ttfa_ratio(self) -> float:
        """The lower baseline TTFA p50 over mstar's."""
        return self.better_baseline(lambda s: s.ttfa_p50_ms, low=True).ttfa_p50_ms / self.systems["mstar"].ttfa_p50_ms


@dataclass
class OmniBenchResult:
    config: str
    text_tokens: int
    talker_steps: int
    sampled: bool
    repeats: int
    threads: int
    results: list[ConcurrencyResult]
    profile: str = ""
    prefix_caching: bool = True
    prefix_tokens: tuple[int, int] = (0, 0)  # mstar Thinker prompt tokens (reused from the cache, looked up)
    talker_prefix_rows: tuple[int, int] = (0, 0)  # the same for the Talker's prompt rows


# -- mstar ------------------------------------------------------------------------------------------
def mstar_params(text_tokens: int, talker_steps: int, sample: bool, seed: int) -> dict[str, Any]:
    talker = {**(SAMPLED_TALKER if sample else {"temperature": 0.0}), "max_tokens": talker_steps,
              "ignore_eos": True, "seed": seed}
    return {"audio": True, "voice": VOICE, "max_tokens": text_tokens, "talker_sampling": talker}


def run_mstar(rt: Runtime, batch: list[list[int]], params: list[dict[str, Any]]) -> SystemRun:
    """Submit every request in one step; time each one's streamed items."""

    async def consume(handle, submitted: float) -> RequestResult:
        clock, text, frames = AudioClock(submitted), [], []
        async for item in handle:
            if item.name == "audio":
                clock.add(item.value)
            elif item.name == "text":
                text += [int(t) for v in item.value for t in v.reshape(-1)]
            elif item.name == "frame_codes":
                frames += [v.reshape(-1) for v in item.value if v.numel()]
        ttfa, end = clock.times()
        out = handle.result()
        if not out.finished:
            raise RuntimeError(f"mstar request {handle.request_id} failed: {out.error}")
        codes = torch.stack(frames) if frames else torch.zeros(0, 16, dtype=torch.long)
        return RequestResult(ttfa, end, clock.samples, text, codes)

    runs: list[SystemRun] = []

    async def main() -> None:  # returns nothing: asyncio.run's exit formats the main task's repr (its result too)
        with rt.held():
            t0 = time.perf_counter()
            subs = [(rt.submit({"input_ids": torch.tensor(p)}, q), time.perf_counter()) for p, q in zip(batch, params)]
        reqs = await asyncio.gather(*(consume(h, s) for h, s in subs))
        runs.append(SystemRun(time.perf_counter() - t0, list(reqs)))

    asyncio.run(main())
    return runs[0]


# -- transformers baselines -------------------------------------------------------------------------
def build_hf(cfg: dict[str, Any], seed: int):
    """``Qwen3OmniMoeForConditionalGeneration`` of ``cfg`` with seeded random weights, eval mode, every
    weight drawn (``loader.hf_reference_model``: transformers leaves the talker's experts unset)."""
    from mstar.models.qwen3_omni.loader import hf_reference_model

    return hf_reference_model(cfg, seed)


def _talker_kwargs(model, talker_steps: int, sample: bool) -> dict[str, Any]:
    """Codec EOS suppressed with the other reserved ids: exactly ``talker_steps - 1`` frames."""
    vocab = model.config.talker_config.text_config.vocab_size
    kw: dict[str, Any] = {"talker_max_new_tokens": talker_steps, "talker_do_sample": sample,
                          "talker_suppress_tokens": list(range(vocab - 1024, vocab))}
    if sample:
        kw.update(talker_temperature=SAMPLED_TALKER["temperature"], talker_top_k=SAMPLED_TALKER["top_k"])
    return kw


@dataclass
class Spoken:
    """One request's output from transformers: generated text ids (up to its EOS), frame codes
    ``[F, 16]`` and waveform."""

    text: list[int]
    codes: torch.Tensor
    wav: torch.Tensor


def hf_generate(model, batch: list[list[int]], text_tokens: int, talker_steps: int, sample: bool,
                seed: int) -> list[Spoken]:
    """One ``generate(return_audio=True)`` over the left-padded prompts (as the processor pads)."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    captured: dict[str, torch.Tensor] = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, *args, **kw):
        captured["codes"] = codes.transpose(1, 2).clone()
        return decode(codes, *args, **kw)

    model.code2wav.chunked_decode = capture
    try:
        torch.manual_seed(seed)
        with torch.inference_mode():
            seq, wav = model.generate(input_ids=ids, attention_mask=mask, speaker=VOICE, return_audio=True,
                                      thinker_max_new_tokens=text_tokens, thinker_do_sample=False,
                                      **_talker_kwargs(model, talker_steps, sample))
    finally:
        del model.code2wav.chunked_decode
    wavs = [wav.reshape(-1)] if isinstance(wav, torch.Tensor) else list(wav)
    eos = model.config.im_end_token_id
    texts = [row[:row.index(eos) + 1] if eos in row else row for row in seq[:, width:].tolist()]
    return [Spoken(t, c, w) for t, c, w in zip(texts, captured["codes"], wavs)]


def run_hf_sequential(model, batch, text_tokens, talker_steps, sample, seed) -> SystemRun:
    t0, reqs = time.perf_counter(), []
    for i, p in enumerate(batch):
        (out,) = hf_generate(model, [p], text_tokens, talker_steps, sample, seed + i)
        done = time.perf_counter() - t0
        reqs.append(RequestResult(done, done, int(out.wav.numel()), out.text, out.codes))
    return SystemRun(time.perf_counter() - t0, reqs)


def run_hf_batched(model, batch, text_tokens, talker_steps, sample, seed) -> SystemRun:
    t0 = time.perf_counter()
    outs = hf_generate(model, batch, text_tokens, talker_steps, sample, seed)
    wall = time.perf_counter() - t0
    return SystemRun(wall, [RequestResult(wall, wall, int(o.wav.numel()), o.text, o.codes) for o in outs])


# -- driver -----------------------------------------------------------------------------------------
def _check(system: str, run: SystemRun, frames: int) -> SystemRun:
    expected = 1920 * frames - 555
    bad = [r.audio_samples for r in run.requests if r.audio_samples != expected]
    if bad:
        raise RuntimeError(f"{system}: audio of {bad} samples, expected {expected} ({frames} frames) each")
    return run


def parity(ours: SystemRun, seq: SystemRun, batched: SystemRun) -> Parity:
    """mstar against hf-sequential request by request (text, codes, audio length; batched: length)."""
    pairs = list(zip(ours.requests, seq.requests, batched.requests))
    return Parity(len(pairs), sum(a.text == b.text for a, b, _ in pairs),
                  sum(a.codes is not None and b.codes is not None and torch.equal(a.codes, b.codes)
                      for a, b, _ in pairs),
                  sum(a.audio_samples == b.audio_samples == c.audio_samples for a, b, c in pairs))


@dataclass
class Workload:
    text_tokens: int
    talker_steps: int
    sample: bool
    seed: int

    def run(self, system: str, rt: Runtime, hf, batch: list[list[int]], rep: int) -> SystemRun:
        seed = self.seed + 1000 * rep
        if system == "mstar":
            params = [mstar_params(self.text_tokens, self.talker_steps, self.sample, seed + i)
                      for i in range(len(batch))]
            run = run_mstar(rt, batch, params)
        elif system == "hf-sequential":
            run = run_hf_sequential(hf, batch, self.text_tokens, self.talker_steps, self.sample, seed)
        else:
            run = run_hf_batched(hf, batch, self.text_tokens, self.talker_steps, self.sample, seed)
        return _check(system, run, self.talker_steps - 1)


def _measure(work: Workload, rt: Runtime, hf, levels: list[int], repeats: int, say,
             warmup: bool = True) -> list[ConcurrencyResult]:
    """Every level's runs. Each repeat runs every (level, system) pair once, in an order the harness
    rotates per repeat, so a host drifting over the suite's minutes reaches every level and system
    alike (the TTFA goal compares the smallest level with the largest). ``warmup``: each timed run
    right after an untimed run of the same system and level (hf-sequential: one request, as it runs
    one at a time), so no run pays for the state another left behind: a process's first batch grows
    its allocator, and any other work before (transformers, a matmul loop, a sleep) leaves mstar's
    next run colder."""
    batches = {c: prompts(c) for c in levels}
    pairs = [(c, system) for c in levels for system in SYSTEMS]

    def warm_up(pair: tuple[int, str]) -> None:
        c, system = pair
        batch = batches[c][:1] if system == "hf-sequential" else batches[c]
        say(f"concurrency {c} {system} warm-up: {work.run(system, rt, hf, batch, 0).wall_s:.2f} s")

    # the harness rotates the order of the (level, system) pairs per repeat; warm_each: an untimed
    # run of the same pair right before each timed one
    def timed(pair: tuple[int, str], rep: int) -> SystemRun:
        c, system = pair
        run = work.run(system, rt, hf, batches[c], rep)
        say(f"concurrency {c} repeat {rep + 1}/{repeats} {system}: {run.wall_s:.2f} s")
        return run

    per = harness.rotate(pairs, timed, repeats, warmup=warm_up, warm=warmup, warm_each=True)
    runs = {c: {s: per[(c, s)] for s in SYSTEMS} for c in levels}
    out = []
    for c in levels:
        par = None if work.sample else parity(*(runs[c][s][0] for s in SYSTEMS))
        out.append(ConcurrencyResult(c, {s: SystemSummary.of(s, c, r) for s, r in runs[c].items()}, par))
    return out


def run_omni_bench(concurrency: list[int], text_tokens: int = 12, talker_steps: int = 61, repeats: int = 2,
                   sample: bool = False, seed: int = 0, config: dict[str, Any] | None = None,
                   profile: bool = True, prefix_caching: bool = True, warmup: bool = True,
                   log: Callable[[str], None] | None = None) -> OmniBenchResult:
    """Build the shared checkpoint, warm every system up, measure the concurrencies, interleaved
    (``_measure``; ``warmup``: each timed run after an untimed one of the same system and level). ``prefix_caching``:
    mstar's Thinker and Talker reuse the KV blocks of prompt rows they have seen (the runtime's default;
    transformers has no such cache): the shared system turn, and since a level's prompts repeat (warm-up,
    repeats) all of a prompt's full blocks; the reuse over the measured runs is reported."""
    from mstar.models.qwen3_omni.model import Qwen3Omni

    if not concurrency or min(concurrency) < 1 or repeats < 1:
        raise ValueError("every concurrency and repeats must be >= 1")
    if text_tokens < 2 or talker_steps < 2:
        raise ValueError("text_tokens and talker_steps must be >= 2 (the talker needs two text tokens)")
    say = log or (lambda _msg: None)
    concurrency = sorted(concurrency)  # the goals read the smallest and the largest
    cfg = config or bench_hf_config()
    work = Workload(text_tokens, talker_steps, sample, seed)
    hf = build_hf(cfg, seed)
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        say(f"checkpoint saved ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M parameters)")
        with Runtime(Qwen3Omni(path), prefix_caching=prefix_caching) as rt:
            warm = Workload(text_tokens, min(talker_steps, 4), sample, seed)
            for system in SYSTEMS:
                warm.run(system, rt, hf, prompts(2), 0)
            before = prefix_tokens(rt, "Thinker"), prefix_tokens(rt, "Talker")
            res = OmniBenchResult(describe_config(cfg), text_tokens, talker_steps, sample, repeats,
                                  torch.get_num_threads(),
                                  _measure(work, rt, hf, concurrency, repeats, say, warmup),
                                  prefix_caching=prefix_caching)
            after = prefix_tokens(rt, "Thinker"), prefix_tokens(rt, "Talker")
            res.prefix_tokens, res.talker_prefix_rows = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
            if profile and not all(ok for _, ok in goals(res)):
                res.profile = profile_mstar(rt, work, max(concurrency))
    return res


def prefix_tokens(rt: Runtime, node: str) -> tuple[int, int]:
    """(prompt rows ``node`` reused from its prefix cache, prompt rows it looked up) so far."""
    kvs = [r["kv"][node] for r in rt.stats()["ranks"] if node in r["kv"]]
    return sum(kv["prefix_hit_tokens"] for kv in kvs), sum(kv["prefix_query_tokens"] for kv in kvs)


PROFILED = ("Thinker", "Talker", "code_predictor", "frame_assembler", "Code2Wav")


def profile_mstar(rt: Runtime, work: Workload, c: int) -> str:
    """One more mstar run at concurrency ``c`` with every node's forward timed: where the wall time goes
    (forward seconds, calls, mean batch) and the rest (scheduling, streams, Python)."""
    spent: dict[str, list[float]] = {n: [] for n in PROFILED}
    sizes: dict[str, int] = {n: 0 for n in PROFILED}
    for name in PROFILED:
        module = rt.local_module(name)

        def timed(*a, _name=name, _forward=module.forward, **kw):
            t0 = time.perf_counter()
            out = _forward(*a, **kw)
            spent[_name].append(time.perf_counter() - t0)
            sizes[_name] += len(next(iter(out.values()))) if out else 0
            return out

        module.forward = timed
    try:
        run = work.run("mstar", rt, None, prompts(c), 99)
    finally:
        for name in PROFILED:
            del rt.local_module(name).forward
    parts = [f"{n} {sum(t):.2f} s ({100 * sum(t) / run.wall_s:.0f}%), {len(t)} calls of "
             f"{1e3 * sum(t) / len(t):.1f} ms, mean batch {sizes[n] / len(t):.1f}" for n, t in spent.items() if t]
    rest = run.wall_s - sum(sum(t) for t in spent.values())
    return f"mstar profile at concurrency {c} (wall {run.wall_s:.2f} s): " + "; ".join(parts) + \
        f"; outside the forwards {rest:.2f} s"


# -- report -----------------------------------------------------------------------------------------
def goals(res: OmniBenchResult) -> list[tuple[str, bool]]:
    """The issue's goals: throughput at the largest concurrency, TTFA at every one, TTFA p95 at the
    largest against TTFA p50 at the smallest."""
    top, low = res.results[-1], res.results[0]
    out = [(f"throughput >= 3x the better baseline at {top.concurrency}: {top.throughput_ratio:.2f}x",
            top.throughput_ratio >= 3.0)]
    out += [(f"TTFA >= 5x lower than the better baseline at {r.concurrency}: {r.ttfa_ratio:.2f}x", r.ttfa_ratio >= 5.0)
            for r in res.results]
    if top is not low:
        p95, p50 = top.systems["mstar"].ttfa_p95_ms, low.systems["mstar"].ttfa_p50_ms
        out.append((f"TTFA p95 at {top.concurrency} <= 2x TTFA at {low.concurrency}: {p95:.0f} ms vs "
                    f"{p50:.0f} ms ({p95 / p50:.2f}x)", p95 <= 2 * p50))
    return out


def format_table(res: OmniBenchResult) -> str:
    talker = "sampled (temperature 0.9, top-k 50)" if res.sampled else "greedy"
    lines = [f"Qwen3-Omni TTS, random weights ({res.config}); thinker greedy "
             f"<= {res.text_tokens} tokens, talker {talker}, {res.talker_steps - 1} frames "
             f"({(res.talker_steps - 1) * 0.08:.2f} s audio) per request, codec EOS suppressed; "
             f"median (min–max) over {res.repeats} repeats, each running every (concurrency, system) pair once in an "
             f"order rotated per repeat, each timed run right after an untimed one of the same pair; "
             f"torch threads {res.threads}", "",
             "| concurrency | system | requests/s | audio-s per wall-s | TTFA p50 ms | TTFA p95 ms | RTF p50 "
             "| throughput vs better baseline | TTFA better baseline / this |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res.results:
        for name, s in r.systems.items():
            mine = name == "mstar"
            tput = f"{r.throughput_ratio:.2f}x" if mine else "—"
            ttfa = f"{r.ttfa_ratio:.2f}x" if mine else "—"
            lines.append(f"| {r.concurrency} | {name} | {spread_cell(s.req_per_s, '.2f')} | "
                         f"{spread_cell(s.audio_s_per_s, '.2f')} | {s.ttfa_p50_ms:.0f} | {s.ttfa_p95_ms:.0f} | "
                         f"{s.rtf_p50:.3f} | {tput} | {ttfa} |")
    lines.append("")
    for r in res.results:
        if r.parity is not None:
            p = r.parity
            lines.append(f"parity at {r.concurrency} (greedy, mstar vs hf-sequential): text {p.text_equal}/"
                         f"{p.requests}, frame codes {p.codes_equal}/{p.requests}, audio length (also "
                         f"hf-batched) {p.length_equal}/{p.requests}")
    (hit, looked), (rows_hit, rows) = res.prefix_tokens, res.talker_prefix_rows
    lines.append(f"mstar prefix cache: the Thinker reused {hit} of {looked} prompt tokens "
                 f"({100 * hit / max(looked, 1):.0f}%), the Talker {rows_hit} of {rows} prompt rows "
                 f"({100 * rows_hit / max(rows, 1):.0f}%): a level's prompts repeat (warm-up, repeats), so a prompt "
                 "reuses its full blocks from its previous run (--no-prefix-caching measures without)"
                 if res.prefix_caching else "mstar prefix cache: off (--no-prefix-caching)")
    lines += [f"goal {'met' if ok else 'NOT met'}: {text}" for text, ok in goals(res)]
    if res.profile:
        lines.append(res.profile)
    return "\n".join(lines)


def to_json(res: OmniBenchResult) -> dict[str, Any]:
    from dataclasses import asdict

    data = asdict(res)
    data["goals"] = [{"goal": text, "met": ok} for text, ok in goals(res)]
    return data
