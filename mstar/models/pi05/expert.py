"""The action expert (Gemma-300M in ``pi05_base``) with adaRMS time conditioning.

Every expert norm is adaptive: ``dense(cond)`` gives ``(scale, shift, gate)`` and
``y = rms(x) * (1 + scale) + shift``; the residuals are gated (``x + f(y) * gate``), and the final
norm's gate is dropped. ``cond = silu(time_mlp_out(silu(time_mlp_in(time_embedding(t)))))`` depends
only on the flow time, so ``ActionExpert.modulations(t)`` computes every norm's modulation for a
time once and the layers read rows of it.

Names equal the checkpoint's: ``layers.{i}.input_layernorm.dense``, ``norm.dense``; the
projections and the time MLP sit on the expert here (top-level keys in the checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.flow import time_embedding
from mstar.models.pi05.prefix import GemmaLayer, Rotary, rms_normalize

__all__ = ["ActionExpert", "AdaRMSNorm", "TimeModulation"]


class AdaRMSNorm(nn.Module):
    """RMSNorm modulated by the time condition; no learned weight of its own."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, modulation: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``modulation`` ``[n, 3 * dim]`` (this norm's ``dense(cond)``, one row per token) -> ``(y, gate)``."""
        if modulation is None:
            raise ValueError("the expert's adaptive norm needs the time modulation")
        scale, shift, gate = modulation.chunk(3, dim=-1)
        y = rms_normalize(x, self.eps) * (1 + scale.float()) + shift.float()
        return y.to(x.dtype), gate.to(x.dtype)


@dataclass(frozen=True)
class TimeModulation:
    """Every adaptive norm's ``dense(cond)`` for one flow time: per layer ``(input, post_attention)``
    ``[1, 3 * width]`` each, and the final norm's."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    final: torch.Tensor


class ActionExpert(nn.Module):
    """Action tokens in (``action_in_proj``), velocity out (``norm`` then ``action_out_proj``)."""

    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.cfg = cfg
        e = cfg.expert
        self.layers = nn.ModuleList(GemmaLayer(e, norm=AdaRMSNorm) for _ in range(e.depth))
        self.norm = AdaRMSNorm(e.width, e.rms_eps)
        self.action_in_proj = nn.Linear(cfg.action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, cfg.action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)
        self.rotary = Rotary(e.head_dim, e.rope_theta)

    def time_condition(self, t: float) -> torch.Tensor:
        """``[1, width]``: the time MLP over the sin/cos embedding of the flow time ``t``."""
        w = self.time_mlp_in.weight
        emb = time_embedding(t, self.cfg.expert.width, self.cfg.min_period, self.cfg.max_period)
        x = F.silu(self.time_mlp_in(emb.to(device=w.device, dtype=w.dtype)))
        return F.silu(self.time_mlp_out(x))

    def modulations(self, t: float) -> TimeModulation:
        cond = self.time_condition(t)
        layers = tuple((layer.input_layernorm.dense(cond), layer.post_attention_layernorm.dense(cond))
                       for layer in self.layers)
        return TimeModulation(layers, self.norm.dense(cond))

    def embed(self, x_t: torch.Tensor) -> torch.Tensor:
        """Noisy actions ``[n, action_dim]`` -> expert tokens ``[n, width]``."""
        w = self.action_in_proj.weight
        return self.action_in_proj(x_t.to(w.dtype))

    def velocity(self, h: torch.Tensor, final_modulation: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[n, width]`` -> the velocity ``[n, action_dim]`` in float32."""
        y, _ = self.norm(h, final_modulation)
        return self.action_out_proj(y).float()
