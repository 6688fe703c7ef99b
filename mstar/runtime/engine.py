"""Engines run one batched forward of a node's module over work items of many requests.

``StatelessEngine`` batches across requests; ``KVCacheEngine`` also owns the paged KV cache of its
module (one block pool; per-request, per-cache-name block tables) and builds the attention
metadata of each batch. A failure inside a batched forward is isolated by re-running the items one
by one, so one bad request fails alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.layers.paged_attention import AttentionMetadata, QueryMode, copy_blocks
from mstar.model.submodule import EngineInputs, ForwardInfo, NodeInputs, NodeSubmodule
from mstar.runtime.kv.block_pool import BlockPool, KVCacheManager, OutOfBlocks


@dataclass(slots=True)
class WorkItem:
    """One node instance of one request, ready to run."""

    seq: int  # arrival order on this worker (FCFS)
    request_id: str
    partition: str
    walk: str
    walk_seq: int
    node: str
    iteration: tuple[int, ...]
    inputs: dict[str, list[torch.Tensor]]
    chunks: dict[str, Any]
    params: Mapping[str, Any]
    home: int


@dataclass
class KVSeq:
    """One sequence of a KV batch (a request may bring several, e.g. rollout samples)."""

    request_id: str
    cache_name: str
    num_tokens: int
    mode: QueryMode
    fork_from: tuple[str, int | None] | None = None
    positions: torch.Tensor | None = None
    refork: bool = False


class ItemError(Exception):
    def __init__(self, item: WorkItem, error: BaseException):
        super().__init__(f"node {item.node!r} (walk {item.walk!r}) failed: {type(error).__name__}: {error}")
        self.item = item


def _as_value(x: Any) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass
class StatelessEngine:
    module: NodeSubmodule
    batch_sizes: list[int] = field(default_factory=list)

    def cache_len(self, item: WorkItem) -> int:
        return 0

    def run(self, items: list[WorkItem]) -> list[dict[str, list[torch.Tensor]] | ItemError]:
        """Outputs per item, in order; an ItemError in place of a failed item."""
        prepared: list[tuple[WorkItem, NodeInputs, ForwardInfo] | ItemError] = []
        prepare = self.module.prepare_inputs
        failed = False
        for item in items:
            info = ForwardInfo(item.request_id, item.walk, item.node, item.iteration, item.params,
                               self.cache_len(item), item.chunks)
            try:
                prepared.append((item, prepare(item.walk, info, item.inputs), info))
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                prepared.append(ItemError(item, e))
                failed = True
        if not failed:
            return self._run_isolated(prepared)
        ok = [p for p in prepared if not isinstance(p, ItemError)]
        outs = iter(self._run_isolated(ok) if ok else [])
        return [p if isinstance(p, ItemError) else next(outs) for p in prepared]

    def _run_isolated(self, batch: list) -> list:
        try:
            return self._forward(batch)
        except Exception as e:  # noqa: BLE001
            if len(batch) == 1:
                self._rollback(batch)
                return [ItemError(batch[0][0], e)]
            self._rollback(batch)
            return [r for b in batch for r in self._run_isolated([b])]

    def _rollback(self, batch: list) -> None:
        pass

    def _engine_inputs(self, batch: list) -> tuple[EngineInputs, dict[str, torch.Tensor]]:
        names = list(batch[0][1].tensor_inputs)
        for item, ni, _ in batch:
            if list(ni.tensor_inputs) != names:
                raise ValueError(f"node {item.node!r}: requests in one batch prepared different tensor names "
                                 f"({sorted(ni.tensor_inputs)} vs {sorted(names)})")
        # a 0-d tensor contributes one row (it comes back from EngineInputs.split with shape [1])
        rows = {n: [ni.tensor_inputs[n].reshape(1) if ni.tensor_inputs[n].dim() == 0 else ni.tensor_inputs[n]
                    for _, ni, _ in batch] for n in names}
        tensors = {n: torch.cat(rows[n], 0) for n in names}
        splits = {n: [t.shape[0] for t in rows[n]] for n in names}
        extra_names = sorted({k for _, ni, _ in batch for k in ni.extras})
        extras = {k: [ni.extras.get(k) for _, ni, _ in batch] for k in extra_names}
        ei = EngineInputs(walks=[i.walk for i, _, _ in batch], nodes=[i.node for i, _, _ in batch],
                          request_ids=[i.request_id for i, _, _ in batch], infos=[f for _, _, f in batch],
                          splits=splits, extras=extras)
        return ei, tensors

    def _call(self, batch: list, ei: EngineInputs, tensors: dict[str, torch.Tensor]) -> list[dict]:
        walks = set(ei.walks)
        with torch.inference_mode():
            out = self.module.forward(walks.pop() if len(walks) == 1 else None, ei, **tensors)
        if not isinstance(out, dict):
            raise TypeError(f"{type(self.module).__name__}.forward must return dict[str, list[Tensor]]")
        for name, vals in out.items():
            if len(vals) != len(batch):
                raise ValueError(f"{type(self.module).__name__}.forward returned {len(vals)} values for "
                                 f"{name!r}, expected one per request ({len(batch)})")
        self.batch_sizes.append(len(batch))
        return [{name: _as_value(vals[i]) for name, vals in out.items()} for i in range(len(batch))]

    def _forward(self, batch: list) -> list[dict]:
        ei, tensors = self._engine_inputs(batch)
        return self._call(batch, ei, tensors)

    def free_request(self, request_id: str) -> None:
        pass

    def export_request(self, request_id: str, free: bool = True) -> dict[str, Any]:
        """This request's state (removed from here unless ``free`` is False); stateless engines hold none."""
        return {}

    def import_request(self, request_id: str, caches: dict[str, Any]) -> None:
        if caches:
            raise ValueError(f"{type(self.module).__name__} holds no KV cache: cannot import one")

    def stats(self) -> dict[str, Any]:
        return {}


class KVCacheEngine(StatelessEngine):
    """Stateless batching plus the module's paged KV cache."""

    def __init__(self, module: NodeSubmodule, num_blocks: int, block_size: int, device: str = "cpu"):
        super().__init__(module)
        spec = module.kv_spec
        self.manager = KVCacheManager(BlockPool(num_blocks, block_size))
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=spec.dtype, device=device),
                           torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)]
        self._appended: list[tuple[str, str, int]] = []

    def cache_len(self, item: WorkItem) -> int:
        return self.manager.num_tokens(item.request_id, item.node)

    def _seqs(self, item: WorkItem, ni: NodeInputs) -> list[KVSeq]:
        if ni.sequences is not None:
            return [KVSeq(item.request_id, q.cache_name, q.num_tokens, QueryMode(q.mode), q.fork_from, None, q.refork)
                    for q in ni.sequences]
        return [KVSeq(item.request_id, ni.cache_name or item.node, ni.num_tokens, QueryMode(ni.mode),
                      ni.fork_from)]

    def _forward(self, batch: list) -> list[dict]:
        ei, tensors = self._engine_inputs(batch)
        seqs = [s for item, ni, _ in batch for s in self._seqs(item, ni)]
        m = self.manager
        self._appended = []
        query_lens, tables, ctx, modes, slots, positions = [], [], [], [], [], []
        try:
            for s in seqs:
                if s.refork and m.has(s.request_id, s.cache_name):
                    m.free(s.request_id, s.cache_name)
                if s.fork_from is not None and not m.has(s.request_id, s.cache_name):
                    src, n = s.fork_from
                    m.fork(s.request_id, src, s.cache_name, n)
                before = m.num_tokens(s.request_id, s.cache_name)
                if s.mode is QueryMode.READ_ONLY:
                    if not m.has(s.request_id, s.cache_name):
                        m.append_slots(s.request_id, s.cache_name, 0)
                    slots += [-1] * s.num_tokens
                    ctx.append(before)
                else:
                    slots += m.append_slots(s.request_id, s.cache_name, s.num_tokens)
                    self._appended.append((s.request_id, s.cache_name, before))
                    ctx.append(before + s.num_tokens)
                query_lens.append(s.num_tokens)
                tables.append(m.block_table(s.request_id, s.cache_name))
                modes.append(s.mode)
                positions.append(s.positions if s.positions is not None
                                 else torch.arange(before, before + s.num_tokens, dtype=torch.long))
        except OutOfBlocks as e:
            raise RuntimeError(f"KV cache exhausted: {e}; raise kv_cache_blocks in the placement") from e
        pairs = m.pop_pending_copies()
        if pairs:
            for k_cache, v_cache in self.kv_caches:
                copy_blocks(k_cache, v_cache, pairs)
        ei.attention = AttentionMetadata.build(query_lens, tables, ctx, modes, slots)
        ei.kv_caches = self.kv_caches
        ei.positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        ei.num_tokens = [sum(s.num_tokens for s in self._seqs(item, ni)) for item, ni, _ in batch]
        return self._call(batch, ei, tensors)

    def _rollback(self, batch: list) -> None:
        """Undo this batch's cache appends so the items can be retried one by one."""
        for rid, name, before in self._appended:
            if self.manager.has(rid, name):
                self.manager.truncate(rid, name, before)
        self._appended = []

    def free_request(self, request_id: str) -> None:
        self.manager.free_request(request_id)

    def _flat(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, head_dim]

    def export_request(self, request_id: str, free: bool = True) -> dict[str, Any]:
        """Gather every cache of the request into dense tensors (forked prefixes are copied); then free
        them here unless ``free`` is False (a copy for another rank)."""
        m = self.manager
        out = {}
        for name in m.cache_names(request_id):
            idx = torch.tensor(m.slot_mapping(request_id, name), dtype=torch.long)
            out[name] = {"num_tokens": m.num_tokens(request_id, name),
                         "k": [self._flat(k)[idx].clone() for k, _ in self.kv_caches],
                         "v": [self._flat(v)[idx].clone() for _, v in self.kv_caches]}
        if free:
            m.free_request(request_id)
        return out

    def import_request(self, request_id: str, caches: dict[str, Any]) -> None:
        m = self.manager
        for name, c in caches.items():
            if m.has(request_id, name):
                m.free(request_id, name)
            idx = torch.tensor(m.append_slots(request_id, name, c["num_tokens"]), dtype=torch.long)
            for layer, (k, v) in enumerate(self.kv_caches):
                self._flat(k)[idx] = c["k"][layer].to(k.dtype)
                self._flat(v)[idx] = c["v"][layer].to(v.dtype)

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()
