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
from mstar.model.submodule import EngineInputs, ForwardInfo, KVSequence, NodeInputs, NodeSubmodule
from mstar.runtime.failures import FailureKind, KVCacheExhausted, describe
from mstar.runtime.keys import WalkKey
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

    @property
    def walk_key(self) -> WalkKey:
        return WalkKey(self.request_id, self.partition, self.walk_seq)


@dataclass(slots=True)
class Prepared:
    """A work item and what its module's ``prepare_inputs`` made of it."""

    item: WorkItem
    inputs: NodeInputs
    info: ForwardInfo

    def sequences(self) -> list[KVSequence]:
        """The cache sequences this item brings (one, unless the module listed several)."""
        ni = self.inputs
        if ni.sequences is not None:
            return ni.sequences
        return [KVSequence(ni.cache_name or self.item.node, ni.num_tokens, ni.mode, ni.fork_from)]


@dataclass
class _KVPlan:
    """The attention bookkeeping of one batch, sequence by sequence."""

    query_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    modes: list[QueryMode] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)


class ItemError(Exception):
    """One item of a batch failed; ``kind`` classifies the original error."""

    def __init__(self, item: WorkItem, error: BaseException):
        super().__init__(f"node {item.node!r} (walk {item.walk!r}) failed: {describe(error)}")
        self.item = item
        self.kind = FailureKind.of(error)


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
        prepared: list[Prepared | ItemError] = []
        prepare = self.module.prepare_inputs
        failed = False
        for item in items:
            info = ForwardInfo(item.request_id, item.walk, item.node, item.iteration, item.params,
                               self.cache_len(item), item.chunks)
            try:
                prepared.append(Prepared(item, prepare(item.walk, info, item.inputs), info))
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                prepared.append(ItemError(item, e))
                failed = True
        if not failed:
            return self._run_isolated(prepared)
        ok = [p for p in prepared if not isinstance(p, ItemError)]
        outs = iter(self._run_isolated(ok) if ok else [])
        return [p if isinstance(p, ItemError) else next(outs) for p in prepared]

    def _run_isolated(self, batch: list[Prepared]) -> list:
        try:
            return self._forward(batch)
        except Exception as e:  # noqa: BLE001
            if len(batch) == 1:
                self._rollback(batch)
                return [ItemError(batch[0].item, e)]
            self._rollback(batch)
            return [r for b in batch for r in self._run_isolated([b])]

    def _rollback(self, batch: list[Prepared]) -> None:
        pass

    def _engine_inputs(self, batch: list[Prepared]) -> tuple[EngineInputs, dict[str, torch.Tensor]]:
        names = list(batch[0].inputs.tensor_inputs)
        for p in batch:
            if list(p.inputs.tensor_inputs) != names:
                raise ValueError(f"node {p.item.node!r}: requests in one batch prepared different tensor names "
                                 f"({sorted(p.inputs.tensor_inputs)} vs {sorted(names)})")
        # a 0-d tensor contributes one row (it comes back from EngineInputs.split with shape [1])
        rows = {n: [t.reshape(1) if t.dim() == 0 else t for t in (p.inputs.tensor_inputs[n] for p in batch)]
                for n in names}
        tensors = {n: torch.cat(rows[n], 0) for n in names}
        splits = {n: [t.shape[0] for t in rows[n]] for n in names}
        extra_names = sorted({k for p in batch for k in p.inputs.extras})
        extras = {k: [p.inputs.extras.get(k) for p in batch] for k in extra_names}
        ei = EngineInputs(walks=[p.item.walk for p in batch], nodes=[p.item.node for p in batch],
                          request_ids=[p.item.request_id for p in batch], infos=[p.info for p in batch],
                          splits=splits, extras=extras)
        return ei, tensors

    def _call(self, batch: list[Prepared], ei: EngineInputs, tensors: dict[str, torch.Tensor]) -> list[dict]:
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

    def _forward(self, batch: list[Prepared]) -> list[dict]:
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

    def _forward(self, batch: list[Prepared]) -> list[dict]:
        ei, tensors = self._engine_inputs(batch)
        self._appended = []
        plan = _KVPlan()
        try:
            for p in batch:
                for seq in p.sequences():
                    self._plan_sequence(p.item.request_id, seq, plan)
        except OutOfBlocks as e:
            raise KVCacheExhausted(f"KV cache exhausted: {e}; raise kv_cache_blocks in the placement") from e
        pairs = self.manager.pop_pending_copies()
        if pairs:
            for k_cache, v_cache in self.kv_caches:
                copy_blocks(k_cache, v_cache, pairs)
        ei.attention = AttentionMetadata.build(plan.query_lens, plan.tables, plan.context_lens, plan.modes, plan.slots)
        ei.kv_caches = self.kv_caches
        ei.positions = torch.cat(plan.positions) if plan.positions else torch.zeros(0, dtype=torch.long)
        ei.num_tokens = [sum(q.num_tokens for q in p.sequences()) for p in batch]
        return self._call(batch, ei, tensors)

    def _plan_sequence(self, rid: str, seq: KVSequence, plan: _KVPlan) -> None:
        """Fork / allocate the sequence's cache slots (recording appends for a rollback) and add its
        attention bookkeeping to ``plan``."""
        m, name, mode = self.manager, seq.cache_name, QueryMode(seq.mode)
        if seq.refork and m.has(rid, name):
            m.free(rid, name)
        if seq.fork_from is not None and not m.has(rid, name):
            src, n = seq.fork_from
            m.fork(rid, src, name, n)
        before = m.num_tokens(rid, name)
        if mode is QueryMode.READ_ONLY:
            if not m.has(rid, name):
                m.append_slots(rid, name, 0)
            plan.slots += [-1] * seq.num_tokens
            plan.context_lens.append(before)
        else:
            plan.slots += m.append_slots(rid, name, seq.num_tokens)
            self._appended.append((rid, name, before))
            plan.context_lens.append(before + seq.num_tokens)
        plan.query_lens.append(seq.num_tokens)
        plan.tables.append(m.block_table(rid, name))
        plan.modes.append(mode)
        plan.positions.append(torch.arange(before, before + seq.num_tokens, dtype=torch.long))

    def _rollback(self, batch: list[Prepared]) -> None:
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
