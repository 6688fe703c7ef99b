"""``VJepaRequest``: a V-JEPA 2-AC request parsed once (``VJepa2AC.parse_request``): the task and its
numbers, read by ``create_state``, ``next_walk``, ``max_kv_tokens`` and the predictor and CEM nodes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mstar.model.request import ModelRequest
from mstar.model.sendable import register_message

__all__ = ["VJepaRequest", "VJepaTask"]


@register_message
class VJepaTask(enum.StrEnum):
    ROLLOUT = "rollout"  # predict ``horizon`` frames from the context and the given actions
    PLAN = "plan"  # search ``horizon`` actions toward a goal frame (the cross-entropy method)


@register_message
@dataclass(frozen=True)
class VJepaRequest(ModelRequest):
    task: VJepaTask
    horizon: int  # frames to predict (rollout) or actions to plan
    # the CEM's, for a plan (defaults otherwise)
    samples: int = 64  # candidate action sequences per iteration
    topk: int = 8  # the elite the distribution is refit to
    iterations: int = 4
    seed: int = 0  # of the candidates' draws
    init_std: float = 0.1  # the initial spread

    @property
    def plans(self) -> bool:
        return self.task is VJepaTask.PLAN
