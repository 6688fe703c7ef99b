"""BAGEL's flow-matching schedule and classifier-free guidance, as pure functions of a request's
parameters (shared by the nodes, the placement-independent tests and the benchmark oracle).

Schedule: ``num_timesteps`` times ``linspace(1, 0)``, shifted ``t' = s t / (1 + (s - 1) t)``;
``num_timesteps - 1`` Euler steps ``x -= v (t_i - t_{i+1})``. Guidance at step ``i`` applies only when
``lo < t_i <= hi`` (the cfg interval), and only through the text scale: with the text scale at 1 the
main velocity is used as is (as the reference does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from mstar.model.sendable import register_message
from mstar.model.validation import check_int

__all__ = ["EDIT_DEFAULTS", "T2I_DEFAULTS", "FlowSettings", "cfg_combine", "flow_settings", "timestep_schedule"]

MAX_TIMESTEPS = 1001


RENORM_TYPES = ("global", "channel", "text_channel")


@register_message  # inside a BagelRequest
@dataclass(frozen=True)
class FlowSettings:
    """A request's image-generation settings (``flow_settings`` fills them from its parameters)."""

    cfg_text_scale: float
    cfg_img_scale: float
    cfg_interval: tuple[float, float]
    cfg_renorm_type: str
    cfg_renorm_min: float = 0.0
    num_timesteps: int = 50
    timestep_shift: float = 3.0

    @property
    def num_steps(self) -> int:
        return self.num_timesteps - 1

    def scales_at(self, t: float) -> tuple[float, float]:
        """(text scale, image scale) in effect at flow time ``t`` (1.0 outside the cfg interval)."""
        lo, hi = self.cfg_interval
        if lo < t <= hi:
            return self.cfg_text_scale, self.cfg_img_scale
        return 1.0, 1.0

    def branch_active(self, branch: str, t: float) -> bool:
        """Whether a guidance branch's velocity is used at time ``t`` (``cfg_text`` / ``cfg_img``)."""
        s_text, s_img = self.scales_at(t)
        if s_text <= 1.0:
            return False
        return branch == "cfg_text" or s_img > 1.0


# the reference's text-to-image and editing defaults
T2I_DEFAULTS = FlowSettings(cfg_text_scale=4.0, cfg_img_scale=1.0, cfg_interval=(0.4, 1.0), cfg_renorm_type="global")
EDIT_DEFAULTS = FlowSettings(cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_interval=(0.0, 1.0),
                             cfg_renorm_type="text_channel")


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    v = params.get(key)
    if v is None:
        return float(default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} must be a number, got {v!r}")
    return float(v)


def flow_settings(params: Mapping[str, Any], editing: bool) -> FlowSettings:
    """The request's flow settings: the task's defaults (``editing``: an image is in the context),
    overridden by ``params``. Raises ValueError for bad values."""
    d = EDIT_DEFAULTS if editing else T2I_DEFAULTS
    s_text = _number(params, "cfg_text_scale", d.cfg_text_scale)
    s_img = _number(params, "cfg_img_scale", d.cfg_img_scale)
    if s_text < 0 or s_img < 0:
        raise ValueError(f"cfg scales must be >= 0, got cfg_text_scale={s_text}, cfg_img_scale={s_img}")
    interval = params.get("cfg_interval")
    if interval is None:
        interval = d.cfg_interval
    if (not isinstance(interval, (list, tuple)) or len(interval) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in interval)):
        raise ValueError(f"cfg_interval must be two numbers [lo, hi], got {interval!r}")
    lo, hi = float(interval[0]), float(interval[1])
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"cfg_interval must satisfy 0 <= lo <= hi <= 1, got {[lo, hi]}")
    renorm = params.get("cfg_renorm_type") or d.cfg_renorm_type
    if renorm not in RENORM_TYPES:
        raise ValueError(f"cfg_renorm_type must be one of {', '.join(RENORM_TYPES)}, got {renorm!r}")
    renorm_min = _number(params, "cfg_renorm_min", d.cfg_renorm_min)
    if not 0.0 <= renorm_min <= 1.0:
        raise ValueError(f"cfg_renorm_min must be in [0, 1], got {renorm_min}")
    steps = check_int(params.get("num_timesteps", d.num_timesteps), "num_timesteps", 2, MAX_TIMESTEPS)
    shift = _number(params, "timestep_shift", d.timestep_shift)
    if shift <= 0:
        raise ValueError(f"timestep_shift must be > 0, got {shift}")
    return FlowSettings(s_text, s_img, (lo, hi), renorm, renorm_min, steps, shift)


@lru_cache(maxsize=64)
def timestep_schedule(num_timesteps: int, shift: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(t_i, dt_i) for the ``num_timesteps - 1`` steps, computed in float32 like the reference."""
    t = torch.linspace(1, 0, num_timesteps)
    t = shift * t / (1 + (shift - 1) * t)
    dts = t[:-1] - t[1:]
    return tuple(t[:-1].tolist()), tuple(dts.tolist())


def cfg_combine(v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, s_text: float,
                s_img: float, renorm_type: str, renorm_min: float) -> torch.Tensor:
    """Combine one request's velocities ``[N, D]`` as the reference does (``v_text``: the velocity
    without the prompt text; ``v_img``: without the images)."""
    if s_text <= 1.0:
        return v
    if v_text is None or (s_img > 1.0 and v_img is None):
        raise ValueError("cfg_combine: a guidance velocity is missing")
    if renorm_type == "text_channel":
        vt = v_text + s_text * (v - v_text)
        scale = (v.norm(dim=-1, keepdim=True) / (vt.norm(dim=-1, keepdim=True) + 1e-8)).clamp(min=renorm_min, max=1.0)
        vt = vt * scale
        return v_img + s_img * (vt - v_img) if s_img > 1.0 else vt
    vt = v_text + s_text * (v - v_text)
    out = v_img + s_img * (vt - v_img) if s_img > 1.0 else vt
    if renorm_type == "global":
        norm_v, norm_out = v.norm(), out.norm()
    elif renorm_type == "channel":
        norm_v, norm_out = v.norm(dim=-1, keepdim=True), out.norm(dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown cfg_renorm_type {renorm_type!r}")
    scale = (norm_v / (norm_out + 1e-8)).clamp(min=renorm_min, max=1.0)
    return out * scale
