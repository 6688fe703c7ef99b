"""BAGEL's Walk Graph: seven nodes, six walks over one KV cache (the computations: ``nodes.py``).

Requests take different walks: text-to-image is ``prefill_text -> image_gen[_cfg]``, image
understanding ``prefill_text -> prefill_vit -> decode``, editing ``prefill_text -> prefill_vae ->
prefill_vit -> image_gen[_cfg]``. ``LLM_cfg_text`` and ``LLM_cfg_img`` are views of ``LLM``'s
weights with their own caches, run as the guidance branches of a Parallel block. Every walk takes a
``ctx`` input that tells each node where its tokens go (``layout.py``); the flow loops stop after
the request's own number of steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.graph import (
    EMIT_TO_CLIENT,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Parallel,
    Sequential,
    Walk,
    WalkGraph,
)
from mstar.models.bagel.walks import BagelWalk

if TYPE_CHECKING:
    from mstar.models.bagel.model import BagelState

__all__ = ["CTX", "MAX_DECODE_TOKENS", "MAX_FLOW_STEPS", "build_graph", "next_walk"]

MAX_FLOW_STEPS = 1000  # bound of the served flow loops (a request's num_timesteps - 1 steps run)
MAX_DECODE_TOKENS = 4096
CTX = "ctx"  # every walk's layout input: positions and cache lengths (see mstar.models.bagel.layout)
_BRANCHES = (("LLM", "v_main"), ("LLM_cfg_text", "v_cfg_text"), ("LLM_cfg_img", "v_cfg_img"))


def build_graph() -> WalkGraph:
    image_out = GraphEdge(EMIT_TO_CLIENT, "image_output", output_modality="image")
    decoder = GraphNode("vae_decoder", ["latents", CTX], [image_out])
    flow_inputs = ["latents", "time_index", CTX]
    return WalkGraph([
        Walk(BagelWalk.PREFILL_TEXT.value, GraphNode("LLM", ["text_ids", CTX]), inputs=["text_ids", CTX]),  # KV only
        Walk(BagelWalk.PREFILL_VIT.value, _prefill_image("vit_encoder", "vit_embeds"), inputs=["image", CTX]),
        Walk(BagelWalk.PREFILL_VAE.value, _prefill_image("vae_encoder", "vae_latents"), inputs=["image", CTX]),
        Walk(BagelWalk.IMAGE_GEN.value, Sequential([_single_branch_flow(), decoder]), inputs=flow_inputs),
        Walk(BagelWalk.IMAGE_GEN_CFG.value, Sequential([_guided_flow(), decoder]), inputs=flow_inputs),
        Walk(BagelWalk.DECODE.value, _decode(), inputs=["token", CTX]),
    ])


def _prefill_image(encoder: str, tokens: str) -> Sequential:
    return Sequential([GraphNode(encoder, ["image"], [GraphEdge("LLM", tokens)]), GraphNode("LLM", [tokens, CTX])])


def _single_branch_flow() -> DynamicLoop:
    """No guidance: ``LLM`` predicts the velocity and takes the Euler step itself."""
    return DynamicLoop(
        GraphNode("LLM", ["latents", "time_index", CTX], [GraphEdge("LLM", "latents"), GraphEdge("LLM", "time_index")]),
        max_iters=MAX_FLOW_STEPS,
        outputs=[GraphEdge("vae_decoder", "latents")],
    )


def _guided_flow() -> DynamicLoop:
    """Three branches in a Parallel block, joined by ``combine_cfg``, which takes the Euler step."""
    branches = []
    for b, v in _BRANCHES:
        outputs = [GraphEdge("combine_cfg", v)]
        if b == "LLM":  # one branch forwards the loop state to the join
            outputs += [GraphEdge("combine_cfg", "latents"), GraphEdge("combine_cfg", "time_index")]
        branches.append(GraphNode(b, ["latents", "time_index", CTX], outputs))
    feedback = [GraphEdge(b, n) for b, _ in _BRANCHES for n in ("latents", "time_index")]
    combine = GraphNode("combine_cfg", ["v_main", "v_cfg_text", "v_cfg_img", "latents", "time_index", CTX], feedback)
    return DynamicLoop(Sequential([Parallel(branches), combine]), max_iters=MAX_FLOW_STEPS, stop_node="combine_cfg",
                       outputs=[GraphEdge("vae_decoder", "latents")])


def _decode() -> DynamicLoop:
    text_out = GraphEdge(EMIT_TO_CLIENT, "text", output_modality="text")
    return DynamicLoop(GraphNode("LLM", ["token", CTX], [GraphEdge("LLM", "token"), text_out]),
                       max_iters=MAX_DECODE_TOKENS, defer_stop_check=True)


def next_walk(state: BagelState) -> str | None:
    """The walks ``create_state`` planned: one per item of the request, in order, then the final one
    (``decode``, ``image_gen`` or ``image_gen_cfg``); each walk's inputs become the state's tensors."""
    if state.steps:
        walk, tensors = state.steps.pop(0)
    elif state.final is not None:
        walk, tensors = state.final
        state.final = None
    else:
        return None
    state.tensors = dict(tensors)
    return walk
