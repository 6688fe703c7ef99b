"""``mstar bench sampler``: what the OpenAI sampling options cost the batched sampler.

The same 16 concurrent greedy requests (EOS ignored, the same prompts) run twice per repeat, in
rotating order: once with no option, once with every row asking for all of them (presence and
frequency penalties, a ``logit_bias`` of 50 tokens and ``top_logprobs`` 5, so the step computes the
seen-token counts, the bias, a log-softmax over the vocabulary and a top-5 for every row).
Throughput is generated tokens over the wall time of the run, prefill included.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.bench import harness
from mstar.bench.llm_bench import BENCH_SHAPE, make_prompts, model_checkpoint

CONFIGS = ("none", "all options")
GOAL_SLOWDOWN = 0.10  # the bound: at most 10% slower with every option on every row


def options_sampling(vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """The sampling fields of the "all options" rows: both penalties, 50 biased tokens, top-5 logprobs."""
    rng = random.Random(seed)
    bias = {str(t): rng.choice((-5.0, 2.0)) for t in rng.sample(range(3, vocab_size), 50)}
    return {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": bias, "logprobs": 5}


@dataclass(frozen=True)
class SamplerBenchResult:
    model: str
    concurrency: int
    max_tokens: int
    repeats: int
    tok_s: dict[str, list[float]]  # config -> generated tokens per second, one per repeat

    def median(self, config: str) -> float:
        return statistics.median(self.tok_s[config])

    @property
    def slowdown(self) -> float:
        """How much slower the "all options" runs are (median over median, 0.05 = 5% slower)."""
        return 1.0 - self.median("all options") / self.median("none")


def run_sampler_bench(*, model: str = "smollm2", concurrency: int = 16, max_tokens: int = 128, repeats: int = 3,
                      cache_dir: str | Path | None = None, log: Callable[[str], None] | None = None
                      ) -> SamplerBenchResult:
    from mstar.models.llama.model import LlamaLM
    from mstar.runtime.api import Runtime

    path, shape = model_checkpoint(model, cache_dir, BENCH_SHAPE, 0, log=log)
    prompts = make_prompts(concurrency, seed=0, vocab_size=shape.vocab_size)
    base = {"temperature": 0.0, "ignore_eos": True}
    sampling = {"none": base, "all options": {**base, **options_sampling(shape.vocab_size)}}
    with Runtime(LlamaLM(model_path=str(path)), workers="inline") as rt:
        def run(config: str, _repeat: int) -> float:
            params = {"max_tokens": max_tokens, "sampling": sampling[config]}
            with rt.held():  # every request arrives in the same step
                t0 = time.perf_counter()
                handles = [rt.submit({"input_ids": torch.tensor(p)}, params) for p in prompts]
            outs = [h.result() for h in handles]
            wall = time.perf_counter() - t0
            n = sum(len(o.tensors("token")) for o in outs)
            if n != concurrency * max_tokens or not all(o.finished for o in outs):
                raise RuntimeError(f"{config}: {n} tokens of {concurrency * max_tokens}")
            if config == "all options" and any(len(o.outputs.get("logprobs", [])) != max_tokens for o in outs):
                raise RuntimeError("all options: a request is missing logprobs")
            return n / wall

        runs = harness.rotate(list(CONFIGS), run, repeats, log=log, label=lambda v: f"{v:.1f} tok/s")
    return SamplerBenchResult(model, concurrency, max_tokens, repeats, {c: runs[c] for c in CONFIGS})


def format_table(res: SamplerBenchResult) -> str:
    rows = []
    for c in CONFIGS:
        v = res.tok_s[c]
        rows.append([c, f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})",
                     f"{res.median(c) / res.median('none'):.3f}x"])
    return harness.markdown_table(["sampling on every row", "tok/s, median (min–max)", "vs none"], rows)


def goal_line(res: SamplerBenchResult) -> harness.Goal:
    return harness.Goal(f"{res.concurrency} concurrent with every option on every row at most "
                        f"{GOAL_SLOWDOWN:.0%} slower: {res.slowdown:.1%} slower", res.slowdown <= GOAL_SLOWDOWN)
