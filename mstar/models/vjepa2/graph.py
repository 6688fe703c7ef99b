"""V-JEPA 2-AC as a Walk Graph: encode context frames, then roll the world model out frame by frame
over a persistent, frame-causal KV cache.

::

    encode:   frames -> encoder -> context (TO_STATE), feed (TO_STATE: the carried frame's first value)
    rollout:  DynamicLoop(predictor: context, actions, states, feed, state
                            -> feed, state (fed back), frame (client, one per predicted frame), stop)

Iteration i appends ONE frame block -- [action_i, state_i, 256 patch tokens] -- to the request's
predictor cache in "block append" mode (the block attends to every cached frame and to itself in
both directions; the reference's mask is frame-causal, so caching past frames is exact). Frames
0..T-1 are the context; from i = T-1 on, the block's output is the prediction of frame i+1
(layer-normed, as the reference's world-model wrapper does), which is streamed to the client and
fed back as frame i+1. States past the context are integrated on the node, in torch, from the
previous state and action (``compute_new_pose``). The native reference instead re-runs the
predictor over the whole trajectory at every step: (H+1)/2 times the token work at horizon H.

Planning (``task="plan"``): ``encode_plan`` (the goal frame too), ``prefill_context`` (the context
frames but the last, into the request's cache) and ``plan``, a CEM loop whose inner ``horizon`` loop
rolls every sample out in its own fork of that cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Sequential,
    Walk,
    WalkGraph,
)

if TYPE_CHECKING:
    from mstar.model.base import WalkState

__all__ = ["MAX_FRAMES", "build_graph", "next_walk"]

MAX_FRAMES = 64  # context + predicted frames per request (bounds the rollout loop)


def build_graph(max_frames: int = MAX_FRAMES, max_cem_iters: int = 64) -> WalkGraph:
    encode = GraphNode("encoder", ["frames"], [GraphEdge(TO_STATE, "context"), GraphEdge(TO_STATE, "feed")])
    encode_plan = GraphNode("encoder", ["frames", "goal_frame"],
                            [GraphEdge(TO_STATE, "context"), GraphEdge(TO_STATE, "feed"), GraphEdge(TO_STATE, "goal")])
    rollout = DynamicLoop(
        GraphNode("predictor", ["context", "actions", "states", "feed", "state"],
                  [GraphEdge("predictor", "feed"), GraphEdge("predictor", "state"),
                   GraphEdge(EMIT_TO_CLIENT, "frame", output_modality="latent")]),
        max_iters=max_frames,
    )
    prefill_context = DynamicLoop(GraphNode("predictor", ["context", "actions", "states"]), max_iters=max_frames)
    plan = DynamicLoop(
        Sequential([
            GraphNode("cem_sampler", ["plan", "spread"],
                      [GraphEdge("predictor", "candidates"), GraphEdge("cem_update", "candidates")]),
            DynamicLoop(
                GraphNode("predictor", ["context", "states", "candidates", "feed", "state"],
                          [GraphEdge("predictor", "feed"), GraphEdge("predictor", "state")]),
                max_iters=max_frames, outputs=[GraphEdge("cem_update", "feed")], name="horizon"),
            GraphNode("cem_update", ["feed", "candidates", "goal"],
                      [GraphEdge("cem_sampler", "plan"), GraphEdge("cem_sampler", "spread"),
                       GraphEdge(EMIT_TO_CLIENT, "energy")]),
        ]),
        max_iters=max_cem_iters, stop_node="cem_update", name="cem",
        outputs=[GraphEdge(EMIT_TO_CLIENT, "plan", output_modality="actions")],
    )
    return WalkGraph([
        Walk("encode", encode, inputs=["frames"]),
        Walk("encode_plan", encode_plan, inputs=["frames", "goal_frame"]),
        Walk("rollout", rollout, inputs=["context", "actions", "states", "feed", "state"]),
        Walk("prefill_context", prefill_context, inputs=["context", "actions", "states"]),
        Walk("plan", plan, inputs=["plan", "spread", "context", "states", "feed", "state", "goal"]),
    ])


def next_walk(state: WalkState) -> str | None:
    """rollout: ``encode`` (when given frames), then ``rollout``; plan: ``encode_plan`` (when given
    frames), ``prefill_context`` (with two context frames or more), then ``plan``."""
    frames = "frames" in state.tensors
    if state.params.plans:  # a VJepaRequest
        prefill = ["prefill_context"] if _context_frames(state.tensors) >= 2 else []
        order = (["encode_plan"] if frames else []) + prefill + ["plan"]
    else:
        order = (["encode"] if frames else []) + ["rollout"]
    done = len(state.history)
    return order[done] if done < len(order) else None


def _context_frames(tensors: Mapping[str, list[Any]]) -> int:
    """Context frames of a request: its ``frames`` [T, 3, H, W] or its encoded ``context`` [T, N, D]."""
    return (tensors["frames"] if "frames" in tensors else tensors["context"])[0].shape[0]
