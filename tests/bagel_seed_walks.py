"""The seed's declarations of BAGEL's image-generation walks, as written there: a fixed 49-step flow
``Loop`` without the ``ctx`` input, one branch or three guidance branches joined by ``combine_cfg``.

They show that the Walk Graph expresses the seed as it stands (the tests compile them); the walks
mstar serves, which stop after each request's own number of steps, are ``graph.py``'s.
"""

from __future__ import annotations

from mstar.graph import EMIT_TO_CLIENT, GraphEdge, GraphNode, Loop, Parallel, Sequential

__all__ = ["NUM_FLOW_STEPS", "image_gen_cfg_walk", "image_gen_walk", "vae_decoder_node"]

NUM_FLOW_STEPS = 49


def vae_decoder_node() -> GraphNode:
    return GraphNode(
        name="vae_decoder",
        input_names=["latents"],
        outputs=[GraphEdge(next_node=EMIT_TO_CLIENT, name="image_output", output_modality="image")],
    )


def image_gen_walk() -> Sequential:
    """The seed's single-branch flow loop, as written there."""
    return Sequential([
        Loop(
            section=GraphNode(
                name="LLM",
                input_names=["latents", "time_index"],
                outputs=[
                    GraphEdge(next_node="LLM", name="latents"),  # feeds back to itself
                    GraphEdge(next_node="LLM", name="time_index"),
                ],
            ),
            max_iters=NUM_FLOW_STEPS,
            outputs=[GraphEdge(next_node="vae_decoder", name="latents")],
        ),
        vae_decoder_node(),
    ])


def image_gen_cfg_walk() -> Sequential:
    """Three guidance branches in a Parallel block, joined by combine_cfg, 49 times."""
    branches = ["LLM", "LLM_cfg_text", "LLM_cfg_img"]
    velocity = {"LLM": "v_main", "LLM_cfg_text": "v_cfg_text", "LLM_cfg_img": "v_cfg_img"}
    llm_nodes = []
    for b in branches:
        outputs = [GraphEdge(next_node="combine_cfg", name=velocity[b])]
        if b == "LLM":  # one branch forwards the loop state to the join
            outputs += [GraphEdge(next_node="combine_cfg", name="latents"),
                        GraphEdge(next_node="combine_cfg", name="time_index")]
        llm_nodes.append(GraphNode(name=b, input_names=["latents", "time_index"], outputs=outputs))
    feedback = [GraphEdge(next_node=b, name=n) for b in branches for n in ("latents", "time_index")]
    return Sequential([
        Loop(
            section=Sequential([
                Parallel(llm_nodes),
                GraphNode(
                    name="combine_cfg",
                    input_names=["v_main", "v_cfg_text", "v_cfg_img", "latents", "time_index"],
                    outputs=feedback,
                ),
            ]),
            max_iters=NUM_FLOW_STEPS,
            outputs=[GraphEdge(next_node="vae_decoder", name="latents")],
        ),
        vae_decoder_node(),
    ])
