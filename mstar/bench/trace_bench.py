"""``mstar bench trace``: what keeping walk traces costs. The same ``concurrency`` requests (distinct
prompts, greedy, ``max_tokens`` each, EOS ignored) through two runtimes of one model in this process,
one keeping traces (``trace_requests`` 256, the default) and one not (0), in rotating rounds
(``mstar.bench.harness``): generated tokens per second, and the traced / untraced ratio of the
medians."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar.bench import harness
from mstar.bench.harness import Spread

__all__ = ["TraceBenchResult", "format_table", "run_trace_bench"]

SYSTEMS = ("traced", "untraced")


@dataclass
class TraceBenchResult:
    model: str
    concurrency: int
    max_tokens: int
    repeats: int
    tok_s: dict[str, Spread]
    same_tokens: bool  # both runtimes generated the same tokens

    @property
    def ratio(self) -> float:
        return self.tok_s["traced"].median / self.tok_s["untraced"].median


def _prompts(n: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (24 + 3 * i,), generator=g) for i in range(n)]


def run_trace_bench(model: str = "smollm2-135m", concurrency: int = 16, max_tokens: int = 64, repeats: int = 3,
                    log: Callable[[str], None] = lambda _: None) -> TraceBenchResult:
    from mstar.runtime.api import Runtime

    runtimes = {"traced": Runtime(model, trace_requests=256).start(), "untraced": Runtime(model, trace_requests=0).start()}
    try:
        prompts = _prompts(concurrency, 250)  # ids every family's vocabulary has
        params = {"max_tokens": max_tokens, "sampling": {"temperature": 0.0, "ignore_eos": True}}
        tokens: dict[str, list[list[int]]] = {}

        def run(system: str, _repeat: int) -> float:
            rt = runtimes[system]
            seconds, outs = harness.timed(lambda: [h.result() for h in [rt.submit({"input_ids": p}, params)
                                                                        for p in prompts]])
            tokens[system] = [[int(t) for t in o.tensors("token")] for o in outs]
            return sum(len(t) for t in tokens[system]) / seconds

        runs = harness.rotate(list(SYSTEMS), run, repeats, log=log, label=lambda v: f"{v:.1f} tok/s")
    finally:
        for rt in runtimes.values():
            rt.shutdown()
    return TraceBenchResult(model, concurrency, max_tokens, repeats, {s: Spread.of(v) for s, v in runs.items()},
                            tokens["traced"] == tokens["untraced"])


def format_table(res: TraceBenchResult) -> str:
    head = (f"Model: {res.model}; {res.concurrency} concurrent requests of {res.max_tokens} tokens (greedy), "
            f"{res.repeats} rotating rounds; the same tokens both ways: {'yes' if res.same_tokens else 'NO'}.\n\n")
    rows = [[s, res.tok_s[s].cell(".1f")] for s in SYSTEMS]
    rows.append(["traced / untraced (medians)", f"{res.ratio:.3f}"])
    return head + harness.markdown_table(["runtime", "tok/s: median (min-max)"], rows)
