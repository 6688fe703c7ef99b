"""When autoregressive text generation stops (every family that decodes tokens: Llama, Orpheus, BAGEL,
Qwen3-Omni).

Generation ends after the token that is an EOS id (unless ``ignore_eos``) or one of the request's
``stop_token_ids`` (the stopping token is still emitted), or after ``max_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar.layers.sampling import SamplingParams

__all__ = ["generation_done", "generation_done_rows", "stop_token_set"]


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


def generation_done_rows(tokens: list[int], steps: list[int], params: list[SamplingParams],
                         stop_ids: list[frozenset[int]]) -> list[bool]:
    """``generation_done`` of every row of a batch (one pass, no call per row)."""
    return [tok in stop or step + 1 >= sp.max_tokens for tok, step, sp, stop in zip(tokens, steps, params, stop_ids)]
