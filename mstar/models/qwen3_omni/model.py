"""``Qwen3OmniGraph``: Qwen3-Omni's graph and state machine (``graph.py``) as a ``ModelDef``, without
weights, so that ``mstar graph qwen3-omni`` draws it."""

from __future__ import annotations

from mstar.graph import WalkGraph
from mstar.model import ModelDef, WalkState
from mstar.models.qwen3_omni import graph as qwen3_omni_graph

__all__ = ["Qwen3OmniGraph"]


class Qwen3OmniGraph(ModelDef):
    """Qwen3-Omni's graph and state machine (structure only)."""

    name = "qwen3-omni"

    def build_graph(self) -> WalkGraph:
        return qwen3_omni_graph.build_graph()

    def next_walk(self, state: WalkState) -> str | None:
        return qwen3_omni_graph.next_walk(state)
