"""Qwen3-Omni's Walk Graph: Thinker -> Talker -> Code2Wav, three partitions streaming in a chain.

The Talker's decode is a DynamicLoop that contains the code predictor's fixed Loop (15 code
groups per audio frame), the nesting the paper describes. Structure only: no weights or nodes yet
(``model.py`` makes it drawable with ``mstar graph qwen3-omni``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    Connection,
    DynamicLoop,
    FixedChunkPolicy,
    GraphEdge,
    GraphNode,
    LeftContextChunkPolicy,
    Loop,
    PartitionTopology,
    Sequential,
    StreamingGraphEdge,
    Walk,
    WalkGraph,
)

if TYPE_CHECKING:
    from mstar.model.base import WalkState

__all__ = ["NUM_CODE_GROUPS", "build_graph", "next_walk"]

NUM_CODE_GROUPS = 16


def build_graph() -> WalkGraph:
    states_out = StreamingGraphEdge(next_node="Talker", name="thinker_states", target_partition="Talker")
    text_out = GraphEdge(EMIT_TO_CLIENT, "text", output_modality="text")
    thinker_prefill = GraphNode("Thinker", ["input_ids"], [GraphEdge(TO_STATE, "token"), text_out, states_out])
    thinker_decode = DynamicLoop(
        GraphNode("Thinker", ["token"], [GraphEdge("Thinker", "token"), text_out, states_out]),
        max_iters=2048,
    )
    talker_decode = DynamicLoop(
        Sequential([
            GraphNode("Talker", ["thinker_states", "frame_codes"],
                      [GraphEdge("code_predictor", "talker_hidden"), GraphEdge("code_predictor", "code"),
                       GraphEdge("frame_assembler", "code0")]),
            Loop(
                GraphNode("code_predictor", ["talker_hidden", "code"], [GraphEdge("code_predictor", "code")]),
                max_iters=NUM_CODE_GROUPS - 1,
                outputs=[GraphEdge("frame_assembler", "code")],
                accumulate=["code"],
                name="code_groups",
            ),
            GraphNode("frame_assembler", ["code0", "code"],
                      [GraphEdge("Talker", "frame_codes"),
                       StreamingGraphEdge("Code2Wav", "codec_frames", target_partition="Code2Wav")]),
        ]),
        max_iters=4096,
        stop_node="Talker",
        name="talker_loop",
    )
    code2wav = GraphNode("Code2Wav", ["codec_frames"], [GraphEdge(EMIT_TO_CLIENT, "audio", output_modality="audio")])
    topology = PartitionTopology(connections=[
        Connection("Thinker", "Talker", "thinker_states",
                   lambda: FixedChunkPolicy(chunk_size=1, continue_after_done=True)),
        Connection("Talker", "Code2Wav", "codec_frames",
                   lambda: LeftContextChunkPolicy(chunk=25, left_context=25)),
    ])
    return WalkGraph([
        Walk("thinker_prefill", thinker_prefill, inputs=["input_ids"], partition="Thinker"),
        Walk("thinker_decode", thinker_decode, inputs=["token"], partition="Thinker"),
        Walk("talker_decode", talker_decode, inputs=["frame_codes"], partition="Talker"),
        Walk("code2wav_chunk", code2wav, partition="Code2Wav"),
    ], topology=topology)


def next_walk(state: WalkState) -> str | None:
    """Thinker: prefill, then decode; Talker: one decode walk (fed by the Thinker's stream); Code2Wav:
    one walk per chunk until the stream is drained."""
    if state.partition == "Thinker":
        return {None: "thinker_prefill", "thinker_prefill": "thinker_decode"}.get(state.last_walk)
    if state.partition == "Talker":
        return "talker_decode" if state.last_walk is None else None
    return None if state.stream_done else "code2wav_chunk"
