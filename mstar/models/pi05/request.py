"""``Pi05Params``: a pi0.5 request's params parsed once (``Pi05Model.parse_request``), with what its
check found: the noise seed and the prefix's length. (``Pi05Request`` in ``config.py`` is the
observation itself, the request's inputs.)"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.model.request import ModelRequest
from mstar.model.sendable import register_message

__all__ = ["Pi05Params"]


@register_message
@dataclass(frozen=True)
class Pi05Params(ModelRequest):
    seed: int | None  # the flow's starting noise is drawn from it when none is given (None: a random one)
    prefix_tokens: int  # the prefix's KV tokens: the valid cameras' image tokens and the prompt's
