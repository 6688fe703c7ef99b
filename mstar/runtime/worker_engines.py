"""The engines of the modules placed on a worker's rank: a ``KVCacheEngine`` for a module with a KV
spec, a ``StatelessRowsEngine`` otherwise, and for a module sharded over a tensor-parallel group
its leader's or follower's engine (``runtime/tp/groups.py``); each module's largest batch over
its nodes' placements. The ``Worker`` builds them once, at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.layers.tensor_parallel import apply_tp, shardable
from mstar.model.base import ModelDef
from mstar.runtime.engine import StatelessEngine
from mstar.runtime.kv.engine import KVCacheEngine
from mstar.runtime.kv.sizing import blocks_in_memory
from mstar.runtime.routing import Routing
from mstar.runtime.stateless_rows import StatelessRowsEngine
from mstar.runtime.tp.follower import FollowerEngine
from mstar.runtime.tp.groups import TPContext, build_tp_engine

__all__ = ["RankEngines", "build_engines", "pool_blocks"]


@dataclass
class RankEngines:
    """A rank's engines by module (a followed module's as a ``FollowerEngine``), the shards of the
    tensor-parallel modules it follows, each module's batch limit."""

    engines: dict[str, Any] = field(default_factory=dict)
    shards: dict[str, StatelessEngine] = field(default_factory=dict)  # followed module -> its shard's engine
    max_batch: dict[str, int] = field(default_factory=dict)


def build_engines(model: ModelDef, routing: Routing, nodes: list[str], device: str, tp: TPContext | None,
                  transport: Any) -> RankEngines:
    """Build the submodules of ``nodes`` (this rank's) on ``device`` and one engine per module."""
    placement = routing.placement
    limits = placement.limits
    modules = model.build_submodules(nodes) if nodes else {}
    out = RankEngines()
    for node in nodes:
        base = model.module_of(node)
        module = modules[node]
        module.to(device).eval()
        if base in out.engines:
            pass
        elif tp is not None and base in tp.layouts and shardable(module):
            layout = tp.layouts[base]  # shard the module over its group; the leader's engine mirrors its calls
            apply_tp(module, tp.tp_group(base))
            blocks = pool_blocks(routing, module) if module.kv_spec is not None else 0
            eng = build_tp_engine(module, layout, transport, blocks, limits.kv_block_size, device,
                                  prefix_caching=limits.prefix_caching)
            if not layout.is_leader:
                out.shards[base] = eng
                eng = FollowerEngine(eng)
            out.engines[base] = eng
        else:
            out.engines[base] = (KVCacheEngine(module, pool_blocks(routing, module), limits.kv_block_size, device,
                                               prefix_caching=limits.prefix_caching)
                                 if module.kv_spec is not None else StatelessRowsEngine(module))
        out.max_batch[base] = min(out.max_batch.get(base, 1 << 30), placement.max_batch_size(node))
    return out


def pool_blocks(routing: Routing, module: Any) -> int:
    """``kv_cache_blocks``, or as many blocks as ``kv_cache_memory_gib`` holds for ``module``."""
    limits = routing.placement.limits
    if limits.kv_cache_memory_gib is None:
        return limits.kv_cache_blocks
    return blocks_in_memory(module.kv_spec, limits.kv_block_size, limits.kv_cache_memory_gib)
