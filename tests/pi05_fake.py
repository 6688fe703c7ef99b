"""A fake pi0.5 policy for protocol tests: the real adapter over one stateless node whose actions are
a closed-form function of the request (``expected_actions``), so the tests check exactly what went
in: which cameras were valid, their pixels after resize and scaling, the token ids and the seed."""

from __future__ import annotations

import torch

from mstar.graph import EMIT_TO_CLIENT, GraphEdge, GraphNode, Walk, WalkGraph
from mstar.model import ModelDef, NodeInputs, NodeSubmodule
from mstar.models.pi05 import inputs as pi
from mstar.models.pi05.adapter import Pi05Adapter
from mstar.models.pi05.config import PI05_TINY

CONFIG = PI05_TINY
INPUTS = ["images", "image_masks", "token_ids", "token_mask"]


def features(images: torch.Tensor, masks: torch.Tensor, ids: torch.Tensor, token_mask: torch.Tensor,
             seed: int | None) -> torch.Tensor:
    """What the fake policy sees of a request: the valid cameras' mean pixel per camera slot, the
    sum of the real token ids and the seed."""
    cams = torch.where(masks, images.mean(dim=(1, 2, 3)), torch.zeros(()))
    return torch.cat([cams, (ids * token_mask).sum().reshape(1).to(torch.float32),
                      torch.tensor([float(seed or 0)])])


def expected_actions(feat: torch.Tensor) -> torch.Tensor:
    h = torch.arange(CONFIG.horizon, dtype=torch.float32)[:, None]
    d = torch.arange(CONFIG.action_dim, dtype=torch.float32)[None, :]
    cams, tok, seed = feat[:3], feat[3], feat[4]
    return (cams[0] + 2 * cams[1] + 3 * cams[2]) + 1e-3 * tok + 1e-2 * seed + 1e-3 * h - 2e-3 * d


class FakePolicyNode(NodeSubmodule):
    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        feat = features(*(inputs[n][0] for n in INPUTS), fwd_info.params.get("seed"))
        return NodeInputs(tensor_inputs={"feat": feat.reshape(1, -1)})

    def forward(self, graph_walk, engine_inputs, feat):
        return {"actions": [expected_actions(f) for f in feat]}


class FakePolicy(ModelDef):
    name = "pi05-fake"
    config = CONFIG
    model_path = None

    def __init__(self, stats: pi.NormStats | None = None, tokenizer: pi.PromptTokenizer | None = None):
        self.stats, self.tokenizer = stats or pi.NormStats(), tokenizer

    def build_graph(self):
        node = GraphNode("policy", INPUTS, [GraphEdge(EMIT_TO_CLIENT, "actions", output_modality="action")])
        return WalkGraph([Walk("act", node, inputs=INPUTS)])

    def next_walk(self, state):
        return "act" if state.last_walk is None else None

    def build_submodules(self, node_names):
        return {"policy": FakePolicyNode()}

    def api_adapter(self):
        return Pi05Adapter(self, stats=self.stats, tokenizer=self.tokenizer)
