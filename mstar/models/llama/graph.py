"""Llama text generation as a Walk Graph: ``prefill`` then a ``decode`` DynamicLoop over one ``LLM`` node.

::

    prefill:  input_ids -> LLM -> token (TO_STATE, EMIT "text"), seen, stop (TO_STATE), logprobs (EMIT)
    decode:   DynamicLoop(LLM: token, seen -> token, seen (fed back), token (EMIT "text"), logprobs (EMIT), stop)

``logprobs`` is emitted only for requests that ask for them (after the step's ``token``).

Generation stops at an EOS id (unless ``ignore_eos``), at a ``stop_token_ids`` id (either is
emitted) or after ``max_tokens`` tokens (``mstar.model.decode``); the ``LLM`` node raises the loop's
``stop`` flag as the ``FinishReason``, and when the prefill's flag (in the request's state) says its
token already ends the request, no ``decode`` walk runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.graph import EMIT_TO_CLIENT, TO_STATE, DynamicLoop, GraphEdge, GraphNode, Walk, WalkGraph
from mstar.model.decode import prefill_finish

if TYPE_CHECKING:
    from mstar.model.base import WalkState

__all__ = ["NODE", "build_graph", "next_walk"]

NODE = "LLM"


def build_graph(max_decode_iters: int) -> WalkGraph:
    emit = GraphEdge(EMIT_TO_CLIENT, "token", output_modality="text")
    logprobs = GraphEdge(EMIT_TO_CLIENT, "logprobs", output_modality="logprobs")
    prefill = GraphNode(NODE, ["input_ids"],
                        [GraphEdge(TO_STATE, "token"), GraphEdge(TO_STATE, "seen"), GraphEdge(TO_STATE, "stop"), emit,
                         logprobs])
    decode = DynamicLoop(
        GraphNode(NODE, ["token", "seen"], [GraphEdge(NODE, "token"), GraphEdge(NODE, "seen"), emit, logprobs]),
        max_iters=max_decode_iters,
        defer_stop_check=True,
    )
    return WalkGraph([Walk("prefill", prefill, inputs=["input_ids"]),
                      Walk("decode", decode, inputs=["token", "seen"])])


def next_walk(state: WalkState) -> str | None:
    """``prefill``, then ``decode`` unless the prefill's token is the request's last (its stop flag)."""
    if state.last_walk is None:
        return "prefill"
    if state.last_walk == "prefill" and prefill_finish(state) is None:
        return "decode"
    return None
