"""When autoregressive text generation stops (every family that decodes tokens: Llama, Orpheus, BAGEL).

Generation ends after the token that is an EOS id (unless ``ignore_eos``) or one of the request's
``stop_token_ids`` (the stopping token is still emitted), or after ``max_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar.layers.sampling import SamplingParams

__all__ = ["generation_done", "stop_token_set"]


def stop_token_set(sp: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """Tokens that end generation: ``stop_token_ids``, plus the EOS ids unless ``ignore_eos``."""
    stop = set(sp.stop_token_ids)
    if not sp.ignore_eos:
        stop.update(eos_token_ids)
    return frozenset(stop)


def generation_done(token: int, step: int, sp: SamplingParams, stop_ids: Iterable[int]) -> bool:
    """Whether ``token``, the request's ``step``-th generated token (0: the one the prefill samples),
    is its last: a stop token, or the ``max_tokens``-th."""
    return token in stop_ids or step + 1 >= sp.max_tokens
