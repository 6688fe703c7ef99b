"""The Walk Graph API: declare, validate, compile and draw a composite model's walks.

Pure Python: importing this package never imports torch.
"""

from mstar.graph.chunking import (
    Chunk,
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)
from mstar.graph.finish import FinishReason
from mstar.graph.plan import (
    InputBinding,
    InputKind,
    LoopExit,
    LoopPlan,
    NodePlan,
    Producer,
    Route,
    RouteKind,
    WalkPlan,
)
from mstar.graph.sections import (
    EMIT_TO_CLIENT,
    TO_STATE,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    Section,
    Sequential,
    StreamingGraphEdge,
)
from mstar.graph.topology import DEFAULT_PARTITION, Connection, PartitionTopology
from mstar.graph.walk_graph import Walk, WalkGraph

__all__ = [
    "DEFAULT_PARTITION",
    "EMIT_TO_CLIENT",
    "TO_STATE",
    "Chunk",
    "ChunkPolicy",
    "Connection",
    "DynamicLoop",
    "FinishReason",
    "FixedChunkPolicy",
    "GraphEdge",
    "GraphNode",
    "InputBinding",
    "InputKind",
    "LeftContextChunkPolicy",
    "Loop",
    "LoopExit",
    "LoopPlan",
    "NodePlan",
    "Parallel",
    "PartitionTopology",
    "Producer",
    "Route",
    "RouteKind",
    "Section",
    "Sequential",
    "SlidingWindowChunkPolicy",
    "StreamingGraphEdge",
    "Walk",
    "WalkGraph",
    "WalkPlan",
]
