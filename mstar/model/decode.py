"""When autoregressive text generation stops (every family that decodes tokens: Llama, Orpheus, BAGEL,
Qwen3-Omni).

Generation ends after the token that is an EOS id (unless ``ignore_eos``) or one of the request's
``stop_token_ids`` (the stopping token is still emitted), or after ``max_tokens`` tokens. The stop
node raises its loop's stop flag as the ``FinishReason`` (``mstar.graph.finish``); the prefill's
flag goes to the request's state, where ``next_walk`` and ``finish_reason`` read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from mstar.graph.finish import FinishReason, reason_of

if TYPE_CHECKING:
    from mstar.layers.sampling import SamplingParams
    from mstar.model.base import WalkState

__all__ = ["exact_length_params", "generation_finish", "generation_finish_rows", "prefill_finish", "stop_token_set"]


def stop_token_set(sp: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """Tokens that end generation: ``stop_token_ids``, plus the EOS ids unless ``ignore_eos``."""
    stop = set(sp.stop_token_ids)
    if not sp.ignore_eos:
        stop.update(eos_token_ids)
    return frozenset(stop)


def generation_finish(token: int, step: int, sp: SamplingParams, stop_ids: Iterable[int]) -> FinishReason | None:
    """Whether ``token``, the request's ``step``-th generated token (0: the one the prefill samples),
    is its last, and why: ``STOP`` for a stop token, ``LENGTH`` for the ``max_tokens``-th; None while
    generation goes on. The one place a decoding family decides it (its stop node's stop flag)."""
    if token in stop_ids:
        return _STOP
    return _LENGTH if step + 1 >= sp.max_tokens else None


def generation_finish_rows(tokens: list[int], steps: list[int], params: list[SamplingParams],
                           stop_ids: list[frozenset[int]]) -> list[FinishReason | None]:
    """``generation_finish`` of every row of a batch (one pass, no call per row)."""
    return [_STOP if tok in stop else _LENGTH if step + 1 >= sp.max_tokens else None
            for tok, step, sp, stop in zip(tokens, steps, params, stop_ids)]


def prefill_finish(state: WalkState, signal: str = "stop") -> FinishReason | None:
    """The reason the prefill's token (the request's first) ends it, from the stop flag its walk routed
    to the request's state; None when generation goes on."""
    return reason_of(state.tensors.get(signal))


_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH


def exact_length_params(params: Mapping[str, Any], output_tokens: int) -> dict[str, Any]:
    """``params`` for a generation of exactly ``output_tokens`` tokens (``max_tokens``, EOS ignored):
    what a decoding family's ``ModelDef.sized_request`` submits."""
    sampling = {**dict(params.get("sampling", {})), "ignore_eos": True}
    return {**params, "max_tokens": output_tokens, "sampling": sampling}
