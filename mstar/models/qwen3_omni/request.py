"""``OmniRequest``: a Qwen3-Omni request parsed once (``Qwen3Omni.parse_request``): the Thinker's
sampling and stop ids, and, for speech, the voice and the Talker's and code predictor's sampling.
What ``next_walk``, ``max_kv_tokens`` and the nodes read."""

from __future__ import annotations

from dataclasses import dataclass

from mstar.layers.sampling import SamplingParams
from mstar.model.request import ModelRequest
from mstar.model.sendable import register_message

__all__ = ["OmniRequest"]


@register_message
@dataclass(frozen=True)
class OmniRequest(ModelRequest):
    thinker: SamplingParams
    thinker_stop_ids: tuple[int, ...]  # <|im_end|> (unless ignore_eos) and the stop_token_ids, sorted
    audio: bool = False  # the answer is spoken too (the Talker and Code2Wav run)
    voice: str = "ethan"
    talker: SamplingParams | None = None  # with audio
    predictor: SamplingParams | None = None  # with audio: the code predictor's
    # a text answer that keeps the Thinker's states at its audio clips (as a spoken answer does), so a
    # spoken answer to a prompt starting the same may take those clips from the prefix cache: the
    # realtime route's prefill of a turn while it is spoken (``keep_states`` in the params)
    keep_states: bool = False
