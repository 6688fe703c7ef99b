"""The native V-JEPA 2-AC rollout, the reference's algorithm on our modules: at every step the predictor
runs over the WHOLE trajectory so far (no cache). Tests and benchmarks compare the served rollout with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.models.vjepa2.pose import compute_new_pose
from mstar.models.vjepa2.predictor import ACPredictor

__all__ = ["native_rollout"]


def native_rollout(predictor: ACPredictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
                   horizon: int) -> list[torch.Tensor]:
    """The reference's rollout, for tests and benchmarks: at every step, the predictor over the WHOLE
    trajectory so far (no cache); keep the last frame's prediction, layer-normed; integrate the pose."""
    c = predictor.cfg
    n = c.tokens_per_frame
    z = [f for f in context]
    s = [st for st in states]
    preds = []
    with torch.inference_mode():
        for _ in range(horizon):
            t = len(z)
            out = predictor.forward_full(torch.cat(z)[None], actions[None, :t], torch.stack(s)[None])
            nxt = F.layer_norm(out[0, -n:], (out.shape[-1],))
            preds.append(nxt)
            s.append(compute_new_pose(s[-1], actions[t - 1]))
            z.append(nxt)
    return preds
