"""The KV engine's steady decode path: a forward whose every row was one decode token is kept
(``KeptBatch``), and ``run_rows`` runs the next iterations of its rows from it, without
``prepare_inputs`` or per-item planning (the worker's running rows, ``runtime/running_rows.py``).
``KVRows`` is a part of ``KVCacheEngine`` (a base class), using its manager, caches and
module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mstar.layers.host_longs import HostLongs, long_tensor
from mstar.layers.paged_attention import AttentionMetadata, QueryMode
from mstar.model.submodule import EngineInputs, NodeSubmodule

if TYPE_CHECKING:
    from mstar.runtime.work_items import Prepared, WorkItem

__all__ = ["KeptBatch", "KVRows", "next_inputs", "rows_in", "select_rows"]


def rows_in(last: Any, items: list[WorkItem]) -> tuple[list[int], dict[str, list]] | None:
    """Each item's row in a kept forward ``last`` (its ``items`` and ``outputs``) and those outputs,
    when every item ran in it; else None (also for no forward or no items)."""
    if last is None or not items:
        return None
    row_of = {id(it): i for i, it in enumerate(last.items)}
    rows = [row_of.get(id(it)) for it in items]
    return None if None in rows else (rows, last.outputs)


def next_inputs(module: NodeSubmodule, last: Any) -> tuple[dict[str, torch.Tensor], dict[str, list]] | None:
    """The next batch of every row of the kept forward ``last`` (its ``walk``, ``ei``, ``tensors``,
    ``outputs``, ``items``): the module's ``continue_batch``, each tensor one row per item; None when
    the module declines or a tensor has another number of rows."""
    nxt = module.continue_batch(last.walk, last.ei, last.tensors, last.outputs)
    if nxt is None:
        return None
    for t in nxt[0].values():
        if t.shape[0] != len(last.items):
            return None
    return nxt


def select_rows(rows: list[int], tensors: dict[str, torch.Tensor], args: list
                ) -> tuple[dict[str, torch.Tensor], list]:
    """``next_inputs``' tensors and args of ``rows`` only, in that order."""
    idx = long_tensor(rows)
    return {k: t.index_select(0, idx) for k, t in tensors.items()}, [args[r] for r in rows]


@dataclass(slots=True)
class KeptBatch:
    """A forward whose every row was one decode token, kept so that the next step of the rows that go
    on can be made from it (``KVRows.run_rows``)."""

    items: list[Any]  # the WorkItems, one per row
    walk: str | None  # the walk the forward ran for (None: several)
    ei: EngineInputs
    tensors: dict[str, torch.Tensor]
    outputs: dict[str, list]  # what the module returned
    keys: list[tuple[str, str]]  # each row's KV sequence: (request id, cache name)
    tables: list[Any]  # and its table (``KVCacheManager.tables_of``), so a step looks none up
    positions: HostLongs | None = None  # ``ei.positions``' host buffer, when ``run_rows`` made it


class KVRows:
    """``KVCacheEngine``'s steady decode path."""

    continues_batches = True  # a tensor-parallel leader, whose followers repeat ``run``, says no

    def _init_rows(self) -> None:
        self._decode: KeptBatch | None = None  # the last forward, when its rows may go on
        self._forwards = 0  # forwards of the current ``run`` (more than one: items were isolated)
        self.row_forwards = 0  # forwards made by ``run_rows``

    def rows_of(self, items: list[WorkItem]) -> tuple[list[int], dict[str, list]] | None:
        """Each item's row in the last forward and that forward's outputs, when its rows may go on
        (each one decode token through a module that can continue a batch,
        ``NodeSubmodule.continue_batch``) and every item ran in it; else None."""
        return rows_in(self._decode, items)

    def run(self, items: list[WorkItem]) -> list:
        self._decode, self._forwards = None, 0
        results = super().run(items)
        if self._forwards != 1:  # failures re-ran items one by one: no batch to continue
            self._decode = None
        return results

    def run_rows(self, items: list[WorkItem], rows: list[int]) -> dict[str, list] | None:
        """One forward of ``items``, the next iterations of the last forward's ``rows``
        (``rows_of``), without ``prepare_inputs``: their tensors from the module's
        ``continue_batch``, their KV slots through ``KVCacheManager.append_tokens``. The module's
        outputs as it returned them; None, with nothing changed, when that does not hold (the
        module declines, a row needs the general planning, the forward failed): ``run`` then
        prepares the items."""
        last, self._decode = self._decode, None
        if last is None or (self._swapped and any(it.request_id in self._swapped for it in items)):
            return None
        nxt = next_inputs(self.module, last)
        if nxt is None:
            return None
        tensors, args = nxt
        n, prev = len(rows), last.ei
        same = n == len(last.items) and rows[-1] == n - 1
        if same:  # every row goes on (rows ascend): the per-row lists stay
            keys, tables, infos, walks, nodes = last.keys, last.tables, prev.infos, prev.walks, prev.nodes
            rids = prev.request_ids
        else:
            tensors, args = select_rows(rows, tensors, args)
            keys, tables, infos = [last.keys[r] for r in rows], [last.tables[r] for r in rows], [prev.infos[r] for r in rows]
            walks, nodes, rids = [it.walk for it in items], [it.node for it in items], [it.request_id for it in items]
        planned = self.manager.append_to(tables)
        if planned is None:
            return None
        before, slots, block_lists = planned
        self.step_tokens, self.step_context = n, sum(before) + n
        self.step_attention = self.step_context  # one new token per row
        for info, item, b in zip(infos, items, before):  # each row's ForwardInfo, brought up to date
            info.iteration, info.cache_len = item.iteration, b
        if same:  # the last forward's inputs, brought up to date (the same rows, lists and splits; a module
            ei = prev  # does not keep its ``EngineInputs`` past its forward: ``NodeSubmodule.continue_batch``)
            ei.args = args
        else:
            ones = [1] * n
            ei = EngineInputs(walks=walks, nodes=nodes, request_ids=rids, infos=infos,
                              splits={k: ones for k in tensors}, args=args, kv_caches=self.kv_caches,
                              num_tokens=ones)
        if self.manager.has_pending_copies:
            self._copy_pending()
        meta = ei.attention if same else None
        if meta is not None and meta._all_decode:  # the same rows' last metadata, their next step's now
            meta.next_decode(block_lists, [b + 1 for b in before], slots)
        else:
            ei.attention = AttentionMetadata.decode(block_lists, [b + 1 for b in before], slots)
        pos = last.positions if same else None  # the same rows' positions tensor, rewritten in place
        if pos is None or not pos.write(before):
            pos = HostLongs(before)
            ei.positions = pos.tensor
        try:
            out = self._call_raw(items, ei, tensors, last.walk)
        except Exception:  # noqa: BLE001 - run's general path retries and isolates the failure
            self._undo_appends([(rid, name, b) for (rid, name), b in zip(keys, before)])
            return None
        if same:  # the same rows: the record brought up to date
            last.ei, last.tensors, last.outputs, last.positions = ei, tensors, out, pos
            self._decode = last
        else:
            self._decode = KeptBatch(items, last.walk, ei, tensors, out, keys, tables, pos)
        self.row_forwards += 1
        return out

    def _keep_decode(self, admitted: list[Prepared], ei: EngineInputs, tensors: dict[str, torch.Tensor],
                     out: dict[str, list]) -> None:
        """Remember a forward whose rows may continue: each one decode token of its own causal cache,
        through a module that can continue a batch."""
        self._forwards += 1
        if not self.continues_batches or type(self.module).continue_batch is NodeSubmodule.continue_batch:
            return
        causal = QueryMode.CAUSAL_APPEND
        keys = []
        for p in admitted:
            ni = p.inputs
            if ni.num_tokens != 1 or ni.sequences is not None or ni.fork_from is not None or ni.mode is not causal \
                    or ni.prefix_ids is not None:
                return
            keys.append((p.item.request_id, ni.cache_name or p.item.node))
        tables = self.manager.tables_of(keys)
        if tables is None:
            return
        walks = set(ei.walks)
        self._decode = KeptBatch([p.item for p in admitted], walks.pop() if len(walks) == 1 else None, ei,
                                        tensors, out, keys, tables)
