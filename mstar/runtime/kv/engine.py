"""``KVCacheEngine``: a ``StatelessEngine`` that also owns its module's paged KV cache (see
``mstar.runtime.engine`` for batching, deferral, swap and prefix caching)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mstar.layers.paged_attention import AttentionMetadata, QueryMode, copy_blocks
from mstar.model.submodule import KVSequence, NodeInputs, NodeSubmodule
from mstar.runtime.engine import StatelessEngine
from mstar.runtime.kv.block_pool import BlockPool, OutOfBlocks, prefix_hashes
from mstar.runtime.kv.cache_manager import KVCacheManager
from mstar.runtime.kv.records import KVPlan, PrefixUse, SwappedKV
from mstar.runtime.kv.rows import KVRows
from mstar.runtime.kv.swap import KVSwap
from mstar.runtime.work_items import DEFERRED, Prepared, WorkItem

__all__ = ["KVCacheEngine"]


class KVCacheEngine(KVRows, KVSwap, StatelessEngine):
    """Stateless batching plus the module's paged KV cache: its rows (``KVRows``), its swaps to host
    memory and moves between ranks (``KVSwap``)."""

    holds_kv = True

    def __init__(self, module: NodeSubmodule, num_blocks: int, block_size: int, device: str = "cpu",
                 prefix_caching: bool = False):
        super().__init__(module)
        self.prefix_caching = prefix_caching
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (items that ran)
        self.prefix_hit_tokens = 0  # of which were reused
        self._prefix_uses: dict[int, PrefixUse] = {}  # id(Prepared run) -> its prompt, this batch
        spec = module.kv_spec
        self.manager = KVCacheManager(BlockPool(num_blocks, block_size))
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=spec.dtype, device=device),
                           torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)]
        self._appended: list[tuple[str, str, int]] = []
        self._swapped: dict[str, SwappedKV] = {}
        self.preemptions = 0
        self._init_rows()

    def cache_len(self, item: WorkItem) -> int:
        if self._swapped:
            swapped = self._swapped.get(item.request_id)
            if swapped is not None and item.node in swapped.tables:
                return swapped.tables[item.node][1]
        return self.manager.num_tokens(item.request_id, item.node)

    def _forward(self, batch: list[Prepared]) -> list[dict]:
        """Plan every item's cache slots (an item that cannot get its blocks is left out, ``DEFERRED``),
        then run one forward over the others."""
        self._appended = []
        self._prefix_uses = {}
        plan = KVPlan()
        runs = self._plan_batch(batch, plan)  # what each item runs (None: deferred)
        admitted = [r for r in runs if r is not None]
        if not admitted:
            self._copy_pending()  # copies queued by items rolled back: no pending copy outlives a batch
            return [DEFERRED] * len(batch)
        ei, tensors = self._engine_inputs(admitted)
        self._copy_pending()
        ei.attention = AttentionMetadata.build(plan.query_lens, plan.tables, plan.context_lens, plan.modes, plan.slots)
        ei.kv_caches = self.kv_caches
        ei.positions = plan.position_tensor() if plan.positions else torch.zeros(0, dtype=torch.long)
        ei.num_tokens = [p.inputs.num_tokens if p.inputs.sequences is None else sum(q.num_tokens for q in p.sequences())
                         for p in admitted]
        self.step_tokens, self.step_context = sum(plan.query_lens), sum(plan.context_lens)
        self.step_attention = sum(q * c for q, c in zip(plan.query_lens, plan.context_lens))
        out = self._call_raw(admitted, ei, tensors)
        self._keep_decode(admitted, ei, tensors, out)
        outs = iter(self._rows(out, len(admitted)))
        self._register_prefixes()
        return [DEFERRED if r is None else next(outs) for r in runs]

    def _plan_batch(self, batch: list[Prepared], plan: KVPlan) -> list[Prepared | None]:
        """``_plan_item`` of every item; a decode step's token (one causal-append token, nothing
        forked, listed or swapped out) is planned inline when ``KVCacheManager.append_token`` can
        take it (the same slots and entries as ``_plan_single``)."""
        m, swapped, appended, causal = self.manager, self._swapped, self._appended, QueryMode.CAUSAL_APPEND
        runs: list[Prepared | None] = []
        for p in batch:
            ni, rid = p.inputs, p.item.request_id
            if ni.num_tokens == 1 and ni.mode is causal and ni.sequences is None and ni.fork_from is None \
                    and ni.prefix_ids is None and rid not in swapped:
                name = ni.cache_name or p.item.node
                got = m.append_token(rid, name)
                if got is not None:
                    before, slot, blocks = got
                    appended.append((rid, name, before))
                    plan.slots.append(slot)
                    plan.add(causal, before, 1, before + 1, list(blocks))
                    runs.append(p)
                    continue
            runs.append(self._plan_item(p, plan))
        return runs

    def _plan_item(self, p: Prepared, plan: KVPlan) -> Prepared | None:
        """Swap the item's request in if needed and plan all its sequences; returns what the forward
        runs (the item, or a copy without the tokens a cached prefix supplies), or None (nothing
        planned: no room now)."""
        rid = p.item.request_id
        swapped_in = rid in self._swapped
        if swapped_in and not self.swap_in(rid):
            return None
        mark, appended = plan.mark(), len(self._appended)
        run = self._adopt_prefix(p)
        ni = run.inputs
        try:
            if ni.sequences is None and ni.fork_from is None and ni.mode is QueryMode.CAUSAL_APPEND:
                self._plan_single(rid, ni, p.item.node, plan)
            else:
                for seq in run.sequences():
                    self._plan_sequence(rid, seq, plan)
        except OutOfBlocks:
            plan.reset(mark)
            self._undo_appends(self._appended[appended:])
            del self._appended[appended:]
            self._prefix_uses.pop(id(run), None)
            if swapped_in:
                self.swap_out(rid, preempted=False)
            return None
        return run

    # -- prefix caching ----------------------------------------------------------------------------
    def _adopt_prefix(self, p: Prepared) -> Prepared:
        """For a prompt entering an empty cache: start the cache with its cached prefix blocks and
        return the item without those tokens (recorded so a rollback empties the cache again)."""
        ni, rid = p.inputs, p.item.request_id
        if (not self.prefix_caching or ni.prefix_ids is None or ni.sequences is not None
                or ni.fork_from is not None or QueryMode(ni.mode) is not QueryMode.CAUSAL_APPEND):
            return p
        name, n = ni.cache_name or p.item.node, ni.num_tokens
        if self.manager.num_tokens(rid, name) or ni.prefix_ids.numel() > n:
            return p
        bs = self.manager.block_size
        hashes = prefix_hashes(ni.prefix_ids.tolist(), bs)  # the full blocks of the shareable leading tokens
        reused = self.manager.adopt_prefix(rid, name, hashes[:(n - 1) // bs])  # keep >= 1 token to run
        self._appended.append((rid, name, 0))
        run = p
        if reused:
            tensors = {k: (v[reused:] if k in ni.token_inputs else v) for k, v in ni.tensor_inputs.items()}
            run = Prepared(p.item, dataclasses.replace(ni, tensor_inputs=tensors, num_tokens=n - reused,
                                                       prefix_ids=None),
                           dataclasses.replace(p.info, cache_len=reused))
        self._prefix_uses[id(run)] = PrefixUse(rid, name, hashes, n, reused)
        return run

    def _register_prefixes(self) -> None:
        """After a successful forward: name the prompts' full blocks, count lookups and hits."""
        for use in self._prefix_uses.values():
            self.manager.register_prefix(use.request_id, use.cache_name, use.hashes)
            self.prefix_query_tokens += use.num_tokens
            self.prefix_hit_tokens += use.reused
            if self.trace_note is not None:
                self.trace_note(use.request_id, "prefix_hit_tokens", use.reused)
        self._prefix_uses = {}

    def _copy_pending(self) -> None:
        """Carry out queued copy-on-write copies (before a forward writes, or blocks are saved)."""
        pairs = self.manager.pop_pending_copies()
        if pairs:
            for k_cache, v_cache in self.kv_caches:
                copy_blocks(k_cache, v_cache, pairs)

    def _plan_single(self, rid: str, ni: NodeInputs, node: str, plan: KVPlan) -> None:
        """``_plan_sequence`` for an item's one causal-append sequence (no fork, no sequences list: a
        prompt or a decode step): the same manager calls and plan entries, without a ``KVSequence``."""
        m, name, n = self.manager, ni.cache_name or node, ni.num_tokens
        before = m.num_tokens(rid, name)
        plan.slots += m.append_slots(rid, name, n)
        self._appended.append((rid, name, before))
        plan.add(QueryMode.CAUSAL_APPEND, before, n, before + n, m.block_table(rid, name))

    def _plan_sequence(self, rid: str, seq: KVSequence, plan: KVPlan) -> None:
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
            context = before
        else:
            plan.slots += m.append_slots(rid, name, seq.num_tokens)
            self._appended.append((rid, name, before))
            context = before + seq.num_tokens
        plan.add(mode, before, seq.num_tokens, context, m.block_table(rid, name))

    def _rollback(self, batch: list[Prepared]) -> None:
        """Undo this batch's cache appends so the items can be retried one by one."""
        self._undo_appends(self._appended)
        self._appended = []
        self._prefix_uses = {}

    def _undo_appends(self, appended: list[tuple[str, str, int]]) -> None:
        for rid, name, before in reversed(appended):
            if self.manager.has(rid, name):
                self.manager.truncate(rid, name, before)

    def free_request(self, request_id: str) -> None:
        if self.trace_note is not None:
            self.trace_note(request_id, "kv_blocks_at_end", self.manager.blocks_held(request_id))
        self.manager.free_request(request_id)
        self._swapped.pop(request_id, None)
        super().free_request(request_id)  # the node's own per-request state

    def stats(self) -> dict[str, Any]:
        return {**self.manager.stats(), "swapped_requests": len(self._swapped), "preemptions": self.preemptions,
                "prefix_query_tokens": self.prefix_query_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
                "row_forwards": self.row_forwards}
