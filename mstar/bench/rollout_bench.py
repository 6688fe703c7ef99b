"""``mstar bench rollout``: V-JEPA 2-AC world-model rollout as a Loop over a persistent KV cache
(mstar) against the native rollout that re-runs the predictor over the whole trajectory every step.

Same predictor weights on both sides (the runtime's own module is used for the native loop). The
predictor is scaled down from the real one (default: 256-wide encoder tokens, 192-wide predictor,
6 blocks, 64 patch tokens per frame) so a step is real work on a CPU. Native token work over a
rollout of H steps after T context frames is sum_{k=0}^{H-1} (T + k) frames, against T + H - 1 for
the cached rollout: (H + 1) / 2 at T = 1.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mstar.models.vjepa2.config import PredictorConfig
from mstar.models.vjepa2.model import MAX_FRAMES, VJepa2AC, native_rollout
from mstar.runtime.api import Runtime


@dataclass
class RolloutResult:
    horizon: int
    context: int
    mstar_s: float
    native_s: float
    max_diff: float

    @property
    def speedup(self) -> float:
        return self.native_s / self.mstar_s

    @property
    def work_ratio(self) -> float:
        t, h = self.context, self.horizon
        return sum(t + k for k in range(h)) / (t + h - 1)


def bench_config(embed: int = 256, width: int = 192, depth: int = 6, heads: int = 6, grid: int = 8) -> PredictorConfig:
    return PredictorConfig(img_size=(16 * grid, 16 * grid), embed_dim=embed, predictor_embed_dim=width,
                           depth=depth, num_heads=heads)


def run_rollout_bench(horizons: list[int], context: int = 1, repeats: int = 3, **cfg) -> list[RolloutResult]:
    pc = bench_config(**cfg)
    from mstar.models.vjepa2.config import TINY_ENCODER

    model = VJepa2AC(load_format="dummy", encoder_config=TINY_ENCODER, predictor_config=pc)
    g = torch.Generator().manual_seed(0)
    out = []
    with Runtime(model) as rt:
        pred = rt._workers[0].engines["predictor"].module.predictor
        for h in horizons:
            if context + h > MAX_FRAMES:
                raise ValueError(f"context + horizon must be <= {MAX_FRAMES}")
            ctx = torch.nn.functional.layer_norm(torch.randn(context, pc.tokens_per_frame, pc.embed_dim, generator=g),
                                                 (pc.embed_dim,))
            states = torch.rand(context, 7, generator=g)
            actions = torch.randn(context + h - 1, 7, generator=g) * 0.05
            inputs = {"context": ctx, "states": states, "actions": actions}
            rt.generate([inputs], {"horizon": h})  # warm-up
            ms, ns = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                (o,) = rt.generate([inputs], {"horizon": h})
                ms.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ref = native_rollout(pred, ctx, states, actions, h)
                ns.append(time.perf_counter() - t0)
            diff = max(float((a - b).abs().max()) for a, b in zip(o.tensors("frame"), ref))
            out.append(RolloutResult(h, context, statistics.median(ms), statistics.median(ns), diff))
    return out


def format_table(results: list[RolloutResult]) -> str:
    lines = ["| horizon | context | mstar s | native s | speed-up | token-work ratio | max abs diff |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.horizon} | {r.context} | {r.mstar_s:.3f} | {r.native_s:.3f} | {r.speedup:.2f}x | "
                     f"{r.work_ratio:.2f}x | {r.max_diff:.1e} |")
    return "\n".join(lines)
