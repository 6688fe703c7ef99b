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

from mstar.bench import harness
from mstar.bench.vjepa2_oracle import native_rollout
from mstar.models.vjepa2.config import PredictorConfig
from mstar.models.vjepa2.graph import MAX_FRAMES
from mstar.models.vjepa2.model import VJepa2AC
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


def _timed_pair(fns: dict, repeats: int) -> dict[str, list[tuple[float, object]]]:
    """(seconds, result) of mstar's rollout and the native one, ``repeats`` rotating rounds through the
    harness; only mstar is warmed up (the native loop has no state to warm, and is the slow side)."""
    return harness.rotate(list(fns), lambda s, _r: harness.timed(fns[s]), repeats,
                          warmup=lambda s: fns[s]() if s == "mstar" else None)


def _medians(per: dict[str, list[tuple[float, object]]]) -> tuple[float, float]:
    return tuple(statistics.median(t for t, _ in per[s]) for s in ("mstar", "native"))


def run_rollout_bench(horizons: list[int], context: int = 1, repeats: int = 3, **cfg) -> list[RolloutResult]:
    pc = bench_config(**cfg)
    from mstar.models.vjepa2.config import TINY_ENCODER

    model = VJepa2AC(load_format="dummy", encoder_config=TINY_ENCODER, predictor_config=pc)
    g = torch.Generator().manual_seed(0)
    out = []
    with Runtime(model) as rt:
        pred = rt.local_module("predictor").predictor
        for h in horizons:
            if context + h > MAX_FRAMES:
                raise ValueError(f"context + horizon must be <= {MAX_FRAMES}")
            ctx = torch.nn.functional.layer_norm(torch.randn(context, pc.tokens_per_frame, pc.embed_dim, generator=g),
                                                 (pc.embed_dim,))
            states = torch.rand(context, 7, generator=g)
            actions = torch.randn(context + h - 1, 7, generator=g) * 0.05
            inputs = {"context": ctx, "states": states, "actions": actions}
            fns = {"mstar": lambda i=inputs, h=h: rt.generate([i], {"horizon": h})[0],
                   "native": lambda c=ctx, s=states, a=actions, h=h: native_rollout(pred, c, s, a, h)}
            per = _timed_pair(fns, repeats)
            (_, o), (_, ref) = per["mstar"][-1], per["native"][-1]
            diff = max(float((a - b).abs().max()) for a, b in zip(o.tensors("frame"), ref))
            out.append(RolloutResult(h, context, *_medians(per), diff))
    return out


def format_table(results: list[RolloutResult]) -> str:
    lines = ["| horizon | context | mstar s | native s | speed-up | token-work ratio | max abs diff |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.horizon} | {r.context} | {r.mstar_s:.3f} | {r.native_s:.3f} | {r.speedup:.2f}x | "
                     f"{r.work_ratio:.2f}x | {r.max_diff:.1e} |")
    return "\n".join(lines)


# -- `mstar bench compare rollout`: the configuration against Meta's reference predictor ----------
COMPARE_CONFIG = dict(embed=256, width=256, depth=8, heads=8, grid=8)  # 64 patch tokens per frame
COMPARE_FRAME_SLOTS = 32


def _native_reference(ref, context, states, actions, horizon):
    """Meta's rollout: the reference predictor over the whole trajectory at every step, batched over B."""
    import torch.nn.functional as F

    from mstar.models.vjepa2.pose import compute_new_pose

    b, t, n, d = context.shape
    z, s, preds = context.reshape(b, t * n, d), states, []
    with torch.inference_mode():
        for _ in range(horizon):
            k = z.shape[1] // n
            out = ref(z, actions[:, :k], s)
            nxt = F.layer_norm(out[:, -n:], (d,))
            preds.append(nxt)
            s = torch.cat([s, compute_new_pose(s[:, -1], actions[:, k - 1]).unsqueeze(1)], 1)
            z = torch.cat([z, nxt], 1)
    return preds


@dataclass
class CompareRow(RolloutResult):
    batch: int = 1


def run_rollout_compare(horizons: list[int], batches: list[int], repeats: int = 1,
                        cem_samples: int = 64, cem_horizon: int = 4, cem_iters: int = 2):
    from mstar.bench.vjepa2_reference import reference_predictor
    from mstar.models.vjepa2.config import TINY_ENCODER

    pc = bench_config(**COMPARE_CONFIG)
    model = VJepa2AC(load_format="dummy", encoder_config=TINY_ENCODER, predictor_config=pc)
    g = torch.Generator().manual_seed(0)
    rows, cem = [], {}
    from mstar.placement import Placement

    placement = Placement.from_dict({"model": model.name, "runtime": {"kv_cache_blocks": 8192},
                                     "node_groups": [{"node_names": sorted(model.graph.node_names), "ranks": [0]}]})
    with Runtime(model, placement) as rt:
        ours = rt.local_module("predictor").predictor
        ref = reference_predictor(pc, COMPARE_FRAME_SLOTS)
        ref.load_state_dict(ours.state_dict())
        n, d = pc.tokens_per_frame, pc.embed_dim
        for b in batches:
            for h in horizons:
                ctx = torch.nn.functional.layer_norm(torch.randn(b, 1, n, d, generator=g), (d,))
                states = torch.rand(b, 1, 7, generator=g)
                actions = torch.randn(b, h, 7, generator=g) * 0.05
                reqs = [{"context": ctx[i], "states": states[i], "actions": actions[i]} for i in range(b)]
                fns = {"mstar": lambda q=reqs, h=h: rt.generate(q, {"horizon": h}),
                       "native": lambda c=ctx, s=states, a=actions, h=h: _native_reference(ref, c, s, a, h)}
                per = _timed_pair(fns, repeats)
                (_, outs), (_, native) = per["mstar"][-1], per["native"][-1]
                diff = max(float((o.tensors("frame")[j] - native[j][i]).abs().max())
                           for i, o in enumerate(outs) for j in range(h))
                rows.append(CompareRow(h, 1, *_medians(per), diff, batch=b))
        # CEM planning throughput: N samples x iterations rollouts of cem_horizon steps
        goal = torch.nn.functional.layer_norm(torch.randn(n, d, generator=g), (d,))
        ctx = torch.nn.functional.layer_norm(torch.randn(2, n, d, generator=g), (d,))
        st, past = torch.rand(2, 7, generator=g), torch.randn(1, 7, generator=g) * 0.05
        params = {"task": "plan", "horizon": cem_horizon, "samples": cem_samples, "topk": 8,
                  "iterations": cem_iters}
        req = {"context": ctx, "goal": goal, "states": st, "actions": past}
        t0 = time.perf_counter()
        (o,) = rt.generate([req], params)
        ours_s = time.perf_counter() - t0
        if not o.finished:
            raise RuntimeError(o.error)
        t0 = time.perf_counter()
        for _ in range(cem_iters):  # the native planner: every sample re-runs the whole trajectory
            cand = torch.randn(cem_samples, cem_horizon, 7, generator=g) * 0.1
            acts = torch.cat([past.expand(cem_samples, 1, 7), cand], 1)
            _native_reference(ref, ctx.expand(cem_samples, 2, n, d), st.expand(cem_samples, 2, 7), acts,
                              cem_horizon)
        native_s = time.perf_counter() - t0
        rollouts = cem_samples * cem_iters
        cem = {"samples": cem_samples, "horizon": cem_horizon, "iterations": cem_iters,
               "mstar_rollouts_per_s": rollouts / ours_s, "native_rollouts_per_s": rollouts / native_s}
    return rows, cem


def format_compare(rows: list[CompareRow], cem: dict) -> str:
    lines = ["| horizon | batch | mstar s | native (reference) s | speed-up | max abs diff |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.horizon} | {r.batch} | {r.mstar_s:.3f} | {r.native_s:.3f} | {r.speedup:.2f}x | "
                     f"{r.max_diff:.1e} |")
    lines.append("")
    lines.append(f"CEM planning, {cem['samples']} samples x {cem['iterations']} iterations, horizon {cem['horizon']}: "
                 f"mstar {cem['mstar_rollouts_per_s']:.1f} rollouts/s, native {cem['native_rollouts_per_s']:.1f} "
                 f"rollouts/s ({cem['mstar_rollouts_per_s'] / cem['native_rollouts_per_s']:.2f}x)")
    return "\n".join(lines)
