"""pi0.5 as a Walk Graph: the observation's prefix once, then the flow loop on the action expert.

::

    prefix:   vision: images, image_masks -> image_embeds ~> prefix: image_embeds, token_ids, token_mask
              (the prefix writes the request's paged KV cache "prefix": valid tokens only, bidirectional)
    actions:  Loop x num_steps (expert: actions -> actions, fed back)  -> actions (client, [horizon, action_dim])

``expert`` is a weight-sharing view of ``prefix`` (one module holds PaliGemma and the expert), so
prefix passes and flow steps of different requests share one queue and run as one forward. Every
flow step attends to the prefix cache READ-ONLY plus its own action tokens; nothing of a step is
stored. The whole loop stays on the rank that holds the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.graph import EMIT_TO_CLIENT, GraphEdge, GraphNode, Loop, Sequential, Walk, WalkGraph

if TYPE_CHECKING:
    from mstar.model.base import WalkState

__all__ = ["ACTION_WALK", "PREFIX_CACHE", "PREFIX_WALK", "WALKS", "build_graph", "next_walk"]

PREFIX_WALK = "prefix"
ACTION_WALK = "actions"
WALKS = (PREFIX_WALK, ACTION_WALK)
PREFIX_CACHE = "prefix"  # the cache name of a request's prefix K/V (on the prefix module)
PREFIX_INPUTS = ["images", "image_masks", "token_ids", "token_mask"]


def build_graph(num_steps: int = 10) -> WalkGraph:
    vision = GraphNode("vision", ["images", "image_masks"], [GraphEdge("prefix", "image_embeds")])
    prefix = GraphNode("prefix", ["image_embeds", "token_ids", "token_mask"])
    flow = Loop(GraphNode("expert", ["actions"], [GraphEdge("expert", "actions")]), max_iters=num_steps,
                name="flow", outputs=[GraphEdge(EMIT_TO_CLIENT, "actions", output_modality="action")])
    return WalkGraph([
        Walk(PREFIX_WALK, Sequential([vision, prefix]), inputs=PREFIX_INPUTS),
        Walk(ACTION_WALK, flow, inputs=["actions"]),
    ])


def next_walk(state: WalkState) -> str | None:
    """``prefix``, then ``actions``, then done."""
    done = len(state.history)
    return WALKS[done] if done < len(WALKS) else None
