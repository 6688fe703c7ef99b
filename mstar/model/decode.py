"""When autoregressive text generation stops (every family that decodes tokens: Llama, Orpheus, BAGEL),
and ``ParamsMemo``: what a node derives from a request's params, computed once per request.

Generation ends after the token that is an EOS id (unless ``ignore_eos``) or one of the request's
``stop_token_ids`` (the stopping token is still emitted), or after ``max_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from mstar.layers.sampling import SamplingParams

__all__ = ["ParamsMemo", "generation_done", "generation_done_rows", "stop_token_set"]

T = TypeVar("T")


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


class ParamsMemo(Generic[T]):
    """``build(params)`` once per request params object (a request brings the same mapping to every
    step), for what a node would otherwise rebuild at every step (its ``SamplingParams``, stop ids).
    An entry holds its params object, so an id cannot be reused while the entry lives; entries of
    finished requests are dropped all at once at ``limit`` entries."""

    def __init__(self, build: Callable[[Mapping[str, Any]], T], limit: int = 4096) -> None:
        self._build = build
        self._limit = limit
        self._entries: dict[int, tuple[Mapping[str, Any], T]] = {}

    def __call__(self, params: Mapping[str, Any]) -> T:
        hit = self._entries.get(id(params))
        if hit is not None and hit[0] is params:
            return hit[1]
        value = self._build(params)
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[id(params)] = (params, value)
        return value
