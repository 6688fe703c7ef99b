"""``LMRequest``: a token LM's request parsed once (``LlamaLM.parse_request``, Orpheus' too): its
sampling and the token ids that end it. What ``next_walk``, ``max_kv_tokens`` and the LM node
read, instead of a params mapping each would parse again."""

from __future__ import annotations

from dataclasses import dataclass

from mstar.layers.sampling import SamplingParams
from mstar.model.decode import stop_token_set
from mstar.model.request import ModelRequest
from mstar.model.sendable import register_message

__all__ = ["LMRequest"]


@register_message
@dataclass(frozen=True)
class LMRequest(ModelRequest):
    sampling: SamplingParams
    stop_ids: tuple[int, ...]  # the model's end-of-sequence ids (unless ignore_eos) and stop_token_ids, sorted

    @classmethod
    def of(cls, sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> LMRequest:
        return cls(sampling, tuple(sorted(stop_token_set(sampling, eos_token_ids))))
