"""``mstar bench sampler``: what the OpenAI sampling options and constrained decoding cost the
batched sampler.

The same 16 concurrent greedy requests (EOS ignored, the same prompts) run three times per repeat,
in rotating order: with no option; with every row asking for all of them (presence and frequency
penalties, a ``logit_bias`` of 50 tokens and ``top_logprobs`` 5, so the step computes the seen-token
counts, the bias, a log-softmax over the vocabulary and a top-5 for every row); and with every row
constrained to a JSON schema (an array of objects, which never has to end, so every step of every
row computes its llguidance token mask). Throughput is generated tokens over the wall time of the
run, prefill included. Schema compile time: a fresh schema (new property names) compiled by the
model's ``GrammarMatchers``, median of 20.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mstar.bench import harness
from mstar.bench.llm_bench import make_prompts

CONFIGS = ("none", "all options", "json schema")
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                     "score": {"type": "integer"}},
                                     "required": ["name", "score"], "additionalProperties": False}}
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
    compile_ms: float  # a fresh JSON schema compiled to a grammar matcher, median

    def median(self, config: str) -> float:
        return statistics.median(self.tok_s[config])

    def slowdown(self, config: str) -> float:
        """How much slower ``config``'s runs are than "none" (median over median, 0.05 = 5% slower)."""
        return 1.0 - self.median(config) / self.median("none")


def run_sampler_bench(*, concurrency: int = 16, max_tokens: int = 128, repeats: int = 3,
                      log: Callable[[str], None] | None = None) -> SamplerBenchResult:
    """SmolLM2-135M-Instruct as ``mstar serve`` runs it (``smollm2-135m``: the packaged GGUF file, its
    own tokenizer, which the grammar engine needs)."""
    from mstar.model import resolve_model
    from mstar.runtime.api import Runtime

    model = resolve_model("smollm2-135m")
    vocab = model.config.vocab_size
    prompts = make_prompts(concurrency, seed=0, vocab_size=vocab)
    base = {"temperature": 0.0, "ignore_eos": True}
    sampling = {"none": base, "all options": {**base, **options_sampling(vocab)},
                "json schema": {**base, "grammar": {"type": "json_schema", "value": SCHEMA}}}
    compile_ms = _compile_ms(model)
    with Runtime(model, workers="inline") as rt:
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
    return SamplerBenchResult(model.name, concurrency, max_tokens, repeats, {c: runs[c] for c in CONFIGS},
                              compile_ms)


def _compile_ms(model: Any) -> float:
    """Median ms to compile a JSON schema never seen before (the tokenizer's vocabulary built first)."""
    from mstar.layers.grammar import GrammarSpec

    engine = model.grammars
    engine.check(GrammarSpec("json_object"))  # builds the llguidance vocabulary once
    times = []
    for i in range(20):
        schema = {"type": "object", "properties": {f"field_{i}_{k}": {"type": t} for k, t in
                                                   enumerate(("string", "integer", "boolean", "number"))},
                  "required": [f"field_{i}_0"]}
        t0 = time.perf_counter()
        engine.check(GrammarSpec("json_schema", json.dumps(schema)))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def format_table(res: SamplerBenchResult) -> str:
    rows = []
    for c in CONFIGS:
        v = res.tok_s[c]
        rows.append([c, f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})",
                     f"{res.median(c) / res.median('none'):.3f}x"])
    table = harness.markdown_table(["sampling on every row", "tok/s, median (min–max)", "vs none"], rows)
    return table + f"\n\nA fresh JSON schema compiles in {res.compile_ms:.2f} ms (median of 20)."


def goal_lines(res: SamplerBenchResult) -> list[harness.Goal]:
    return [harness.Goal(f"{res.concurrency} concurrent with {what} on every row at most {GOAL_SLOWDOWN:.0%} slower: "
                         f"{res.slowdown(config):.1%} slower", res.slowdown(config) <= GOAL_SLOWDOWN)
            for config, what in (("all options", "every option"), ("json schema", "a JSON schema"))]
