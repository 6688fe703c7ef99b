"""BAGEL's Walk Graph: seven nodes, six walks over one KV cache (the computations: ``nodes.py``).

Requests take different walks: text-to-image is ``prefill_text -> image_gen[_cfg]``, image
understanding ``prefill_text -> prefill_vit -> decode``, editing ``prefill_text -> prefill_vae ->
prefill_vit -> image_gen[_cfg]``. ``LLM_cfg_text`` and ``LLM_cfg_img`` are views of ``LLM``'s
weights with their own caches, run as the guidance branches of a Parallel block.
"""

from __future__ import annotations

from mstar.graph import (
    EMIT_TO_CLIENT,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    Sequential,
    Walk,
    WalkGraph,
)

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


MAX_FLOW_STEPS = 1000  # bound of the served flow loops (a request's num_timesteps - 1 steps run)
MAX_DECODE_TOKENS = 4096
CTX = "ctx"  # every walk's layout input: positions and cache lengths (see mstar.models.bagel.layout)


def build_bagel_graph() -> WalkGraph:
    """The served graph: the seed's walks, with the flow loops stopping after the request's own
    number of steps (``DynamicLoop``) and a ``ctx`` input that tells each node where its tokens go."""
    image_out = GraphEdge(EMIT_TO_CLIENT, "image_output", output_modality="image")
    decoder = GraphNode("vae_decoder", ["latents", CTX], [image_out])
    prefill_text = GraphNode("LLM", ["text_ids", CTX])  # writes the KV cache(s) only
    prefill_vit = Sequential([
        GraphNode("vit_encoder", ["image"], [GraphEdge("LLM", "vit_embeds")]),
        GraphNode("LLM", ["vit_embeds", CTX]),
    ])
    prefill_vae = Sequential([
        GraphNode("vae_encoder", ["image"], [GraphEdge("LLM", "vae_latents")]),
        GraphNode("LLM", ["vae_latents", CTX]),
    ])
    # one branch: LLM predicts the velocity and takes the Euler step itself
    image_gen = Sequential([
        DynamicLoop(
            GraphNode("LLM", ["latents", "time_index", CTX],
                      [GraphEdge("LLM", "latents"), GraphEdge("LLM", "time_index")]),
            max_iters=MAX_FLOW_STEPS,
            outputs=[GraphEdge("vae_decoder", "latents")],
        ),
        decoder,
    ])
    branches = []
    for b, v in (("LLM", "v_main"), ("LLM_cfg_text", "v_cfg_text"), ("LLM_cfg_img", "v_cfg_img")):
        outputs = [GraphEdge("combine_cfg", v)]
        if b == "LLM":
            outputs += [GraphEdge("combine_cfg", "latents"), GraphEdge("combine_cfg", "time_index")]
        branches.append(GraphNode(b, ["latents", "time_index", CTX], outputs))
    feedback = [GraphEdge(b, n) for b in ("LLM", "LLM_cfg_text", "LLM_cfg_img") for n in ("latents", "time_index")]
    image_gen_cfg = Sequential([
        DynamicLoop(
            Sequential([
                Parallel(branches),
                GraphNode("combine_cfg", ["v_main", "v_cfg_text", "v_cfg_img", "latents", "time_index", CTX],
                          feedback),
            ]),
            max_iters=MAX_FLOW_STEPS,
            stop_node="combine_cfg",
            outputs=[GraphEdge("vae_decoder", "latents")],
        ),
        decoder,
    ])
    decode = DynamicLoop(
        GraphNode("LLM", ["token", CTX],
                  [GraphEdge("LLM", "token"), GraphEdge(EMIT_TO_CLIENT, "text", output_modality="text")]),
        max_iters=MAX_DECODE_TOKENS,
        defer_stop_check=True,
    )
    return WalkGraph([
        Walk("prefill_text", prefill_text, inputs=["text_ids", CTX]),
        Walk("prefill_vit", prefill_vit, inputs=["image", CTX]),
        Walk("prefill_vae", prefill_vae, inputs=["image", CTX]),
        Walk("image_gen", image_gen, inputs=["latents", "time_index", CTX]),
        Walk("image_gen_cfg", image_gen_cfg, inputs=["latents", "time_index", CTX]),
        Walk("decode", decode, inputs=["token", CTX]),
    ])
