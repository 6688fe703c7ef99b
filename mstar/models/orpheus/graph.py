"""Orpheus TTS's Walk Graph: an LLM partition streaming audio tokens into a codec partition."""

from __future__ import annotations

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
from mstar.model import ModelDef, WalkState

SNAC_WINDOW = 28  # 4 frames of 7 tokens
SNAC_STRIDE = 7  # one new frame


def build_orpheus_graph(max_new_tokens: int = 1200) -> WalkGraph:
    to_codec = StreamingGraphEdge(next_node="snac_decoder", name="audio_token", target_partition="codec")
    prefill = GraphNode(name="LLM", input_names=["input_ids"],
                        outputs=[GraphEdge(TO_STATE, "token"), to_codec])
    decode = DynamicLoop(
        section=GraphNode(name="LLM", input_names=["token"], outputs=[GraphEdge("LLM", "token"), to_codec]),
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
        Walk("decode", decode, inputs=["token"], partition="llm"),
        Walk("snac_chunk", codec, partition="codec"),
    ], topology=topology)


class OrpheusGraph(ModelDef):
    """Orpheus's graph and state machine (structure only)."""

    name = "orpheus"

    def build_graph(self) -> WalkGraph:
        return build_orpheus_graph()

    def next_walk(self, state: WalkState) -> str | None:
        if state.partition == "codec":
            return None if state.stream_done else "snac_chunk"
        return {None: "prefill", "prefill": "decode"}.get(state.last_walk)
