"""The flow-matching schedule of pi0.5 (openpi ``sample_actions``, lerobot ``euler_integrate``).

t = 1 is noise and t = 0 the action chunk. With ``n`` steps, ``dt = -1 / n`` and step ``k`` is at
``t_k = 1 + k * dt`` (1.0, 0.9, ..., 0.1 for n = 10); each step is ``x <- x + dt * v(x, t_k)``, so
after ``n`` steps x is at t = 0. Times are formed in Python floats and rounded to float32 once, as
the reference does; the sin/cos embedding runs in float64.
"""

from __future__ import annotations

import math

import torch

__all__ = ["euler_step", "step_dt", "step_time", "time_embedding"]


def step_dt(num_steps: int) -> float:
    return -1.0 / num_steps


def step_time(step: int, num_steps: int) -> float:
    """The flow time of step ``step`` (0-based), as the float32 value the reference uses."""
    return float(torch.tensor(1.0 + step * step_dt(num_steps), dtype=torch.float32))


def euler_step(x_t: torch.Tensor, velocity: torch.Tensor, num_steps: int) -> torch.Tensor:
    return x_t + step_dt(num_steps) * velocity


def time_embedding(t: float, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """``[1, dim]`` float32: ``[sin(2 pi t / p), cos(2 pi t / p)]`` over ``dim / 2`` periods ``p``
    spaced geometrically from ``min_period`` to ``max_period``."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    scaling = 1.0 / period * 2 * math.pi
    x = scaling[None, :] * torch.tensor([t], dtype=torch.float32)[:, None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=1).float()
