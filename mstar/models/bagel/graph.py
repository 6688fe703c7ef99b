"""BAGEL's Walk Graph: seven nodes, six walks over one KV cache (structure only; weights come later).

Requests take different walks: text-to-image is ``prefill_text -> image_gen[_cfg]``, image
understanding ``prefill_text -> prefill_vit -> decode``, editing ``prefill_text -> prefill_vae ->
prefill_vit -> image_gen[_cfg]``. ``LLM_cfg_text`` and ``LLM_cfg_img`` are views of ``LLM``'s
weights with their own caches, run as the guidance branches of a Parallel block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from mstar.model import ModelDef, WalkState

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


def build_bagel_graph() -> WalkGraph:
    prefill_text = GraphNode(name="LLM", input_names=["text_ids"])  # writes the KV cache only
    prefill_vit = Sequential([
        GraphNode(name="vit_encoder", input_names=["image"], outputs=[GraphEdge("LLM", "vit_embeds")]),
        GraphNode(name="LLM", input_names=["vit_embeds"]),
    ])
    prefill_vae = Sequential([
        GraphNode(name="vae_encoder", input_names=["image"], outputs=[GraphEdge("LLM", "vae_latents")]),
        GraphNode(name="LLM", input_names=["vae_latents"]),
    ])
    decode = DynamicLoop(
        section=GraphNode(
            name="LLM",
            input_names=["token"],
            outputs=[GraphEdge("LLM", "token"), GraphEdge(EMIT_TO_CLIENT, "text", output_modality="text")],
        ),
        max_iters=4096,
        defer_stop_check=True,
    )
    return WalkGraph([
        Walk("prefill_text", prefill_text, inputs=["text_ids"]),
        Walk("prefill_vit", prefill_vit, inputs=["image"]),
        Walk("prefill_vae", prefill_vae, inputs=["image"]),
        Walk("image_gen", image_gen_walk(), inputs=["latents", "time_index"]),
        Walk("image_gen_cfg", image_gen_cfg_walk(), inputs=["latents", "time_index"]),
        Walk("decode", decode, inputs=["token"]),
    ])


@dataclass
class BagelState(WalkState):
    prefill_steps: list[str] = field(default_factory=list)
    target: str = "text"
    cfg: bool = False


class BagelGraph(ModelDef):
    """BAGEL's graph and state machine (no weights: drawable and checkable, not servable yet)."""

    name = "bagel"
    views = {"LLM_cfg_text": "LLM", "LLM_cfg_img": "LLM"}

    def build_graph(self) -> WalkGraph:
        return build_bagel_graph()

    def create_state(self, request_id, partition, inputs, params):
        steps = ["prefill_text"]
        if "image" in inputs:
            steps += ["prefill_vae", "prefill_vit"] if params.get("target") == "image" else ["prefill_vit"]
        return BagelState(request_id=request_id, partition=partition, params=params, tensors=dict(inputs),
                          prefill_steps=steps, target=params.get("target", "text"), cfg=params.get("cfg", False))

    def next_walk(self, state: BagelState) -> str | None:
        if state.prefill_steps:  # still consuming inputs
            return state.prefill_steps.pop(0)
        if state.last_walk in ("image_gen", "image_gen_cfg", "decode"):
            return None
        if state.target == "image":
            return "image_gen_cfg" if state.cfg else "image_gen"
        return "decode"
