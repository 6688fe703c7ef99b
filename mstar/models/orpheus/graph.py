"""Orpheus TTS's Walk Graph: an LLM partition streaming audio tokens into a codec partition.

::

    partition llm:    prefill: input_ids -> LLM -> token, seen, stop (TO_STATE); audio_token ~> codec; token (client)
                      decode:  DynamicLoop(LLM: token, seen -> token, seen (fed back); audio_token ~> codec;
                                           token (client))
    partition codec:  snac_chunk: audio_token (a 28-token window, stride 7) -> snac_decoder -> audio (client)

Only audio tokens enter the stream (the LLM node sends an empty list for other tokens), so the
codec's stream index of a token is its index among the request's audio tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    PartitionTopology,
    SlidingWindowChunkPolicy,
    StreamingGraphEdge,
    Walk,
    WalkGraph,
)
from mstar.models.llama import graph as llama_graph

if TYPE_CHECKING:
    from mstar.model.base import WalkState

__all__ = ["SNAC_STRIDE", "SNAC_WINDOW", "build_graph", "next_walk"]

SNAC_WINDOW = 28  # 4 frames of 7 tokens
SNAC_STRIDE = 7  # one new frame


def build_graph(max_new_tokens: int = 1200) -> WalkGraph:
    to_codec = StreamingGraphEdge(next_node="snac_decoder", name="audio_token", target_partition="codec")
    tokens_out = GraphEdge(EMIT_TO_CLIENT, "token")  # every generated token, for /generate clients and tests
    prefill = GraphNode(name="LLM", input_names=["input_ids"],
                        outputs=[GraphEdge(TO_STATE, "token"), GraphEdge(TO_STATE, "seen"), GraphEdge(TO_STATE, "stop"),
                                 to_codec, tokens_out])
    decode = DynamicLoop(
        section=GraphNode(name="LLM", input_names=["token", "seen"],
                          outputs=[GraphEdge("LLM", "token"), GraphEdge("LLM", "seen"), to_codec, tokens_out]),
        max_iters=max_new_tokens,
        defer_stop_check=True,
    )
    codec = GraphNode(name="snac_decoder", input_names=["audio_token"],
                      outputs=[GraphEdge(EMIT_TO_CLIENT, "audio", output_modality="audio")])
    topology = PartitionTopology(connections=[
        Connection("llm", "codec", "audio_token",
                   lambda: SlidingWindowChunkPolicy(window=SNAC_WINDOW, stride=SNAC_STRIDE)),
    ])
    return WalkGraph([
        Walk("prefill", prefill, inputs=["input_ids"], partition="llm"),
        Walk("decode", decode, inputs=["token", "seen"], partition="llm"),
        Walk("snac_chunk", codec, partition="codec"),
    ], topology=topology)


def next_walk(state: WalkState) -> str | None:
    """llm: Llama's ``prefill``, then ``decode`` unless the prefill's token is the last (its stop flag);
    codec: one ``snac_chunk`` per chunk until the stream is drained."""
    if state.partition == "codec":
        return None if state.stream_done else "snac_chunk"
    return llama_graph.next_walk(state)
