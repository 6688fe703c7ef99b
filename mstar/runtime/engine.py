"""Engines run one batched forward of a node's module over work items of many requests.

``StatelessEngine`` batches across requests; ``KVCacheEngine`` (``mstar.runtime.kv.engine``) also owns the paged KV cache of its
module (one block pool; per-request, per-cache-name block tables) and builds the attention
metadata of each batch. A failure inside a batched forward is isolated by re-running the items one
by one, so one bad request fails alone.

An item whose KV blocks cannot be had right now is not failed: it comes back as ``DEFERRED`` and
the worker queues it again. ``swap_out`` / ``swap_in`` move a request's blocks to host memory and
back (sharing between its own caches kept), which is how the worker preempts a request under KV
pressure; the request's items swap it back in when they are next admitted.

Prefix caching (``prefix_caching=True``): an item that declares ``NodeInputs.prefix_ids`` (its
leading tokens whose KV depends on the ids alone: all of a text prompt, the part of a multimodal one
before its first media placeholder) for an empty cache starts it with the cached blocks of the
longest cached full-block prefix of those and computes only the rest; after its forward succeeds
the full blocks of those tokens are registered under their content hashes, so later requests with
the same leading tokens reuse them (``BlockPool`` keeps released registered blocks until the space
is needed, least recently released first).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.model.submodule import EngineInputs, ForwardInfo, NodeSubmodule
from mstar.runtime.work_items import DEFERRED, ItemError, Prepared, WorkItem, as_values

__all__ = ["DEFERRED", "ItemError", "Prepared", "StatelessEngine", "WorkItem"]


@dataclass
class StatelessEngine:
    module: NodeSubmodule
    holds_kv = False  # a KV cache engine's blocks and preemptions appear in the rank's stats
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=4096))  # the latest forwards' sizes
    # the last forward's new tokens, attended context tokens and attention pairs (a row's new tokens
    # times its context), summed over its rows (a KV engine's; a stateless one's stay 0): what the
    # rank's trace records of the forward, a planner's cost inputs
    step_tokens: int = 0
    step_context: int = 0
    step_attention: int = 0
    # (request id, key, number) -> None: the rank's trace notes of this module (``trace.NodeRuns.notes_of``;
    # a KV engine notes prefix-cache hits, preemptions and the blocks a request held at its end)
    trace_note: Any = None

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
        inputs = [p.inputs for p in batch]
        first = inputs[0].tensor_inputs
        names = first.keys()
        for ni in inputs:
            if ni.tensor_inputs.keys() != names:
                raise ValueError(f"node {batch[0].item.node!r}: requests in one batch prepared different tensor "
                                 f"names ({sorted(ni.tensor_inputs)} vs {sorted(names)})")
        tensors, splits = {}, {}
        for n in first:
            # a 0-d tensor contributes one row (it comes back from EngineInputs.split with shape [1])
            col = [t.reshape(1) if t.dim() == 0 else t for t in (ni.tensor_inputs[n] for ni in inputs)]
            tensors[n] = torch.cat(col, 0)
            splits[n] = [t.shape[0] for t in col]
        items = [p.item for p in batch]
        ei = EngineInputs(walks=[it.walk for it in items], nodes=[it.node for it in items],
                          request_ids=[it.request_id for it in items], infos=[p.info for p in batch],
                          splits=splits, args=[ni.args for ni in inputs])
        return ei, tensors

    def _call(self, batch: list, ei: EngineInputs, tensors: dict[str, torch.Tensor]) -> list[dict]:
        return self._rows(self._call_raw(batch, ei, tensors), len(batch))

    def _call_raw(self, batch: list, ei: EngineInputs, tensors: dict[str, torch.Tensor],
                  walk: str | None | bool = False) -> dict[str, list]:
        """The module's forward over the batch: its outputs as it returned them, checked. ``walk``: the
        batch's one walk (None: several), when the caller knows it."""
        if walk is False:
            walks = set(ei.walks)
            walk = walks.pop() if len(walks) == 1 else None
        if torch.is_inference_mode_enabled():  # the runtime's loops run in it (no re-entry per forward)
            out = self.module.forward(walk, ei, **tensors)
        else:
            with torch.inference_mode():
                out = self.module.forward(walk, ei, **tensors)
        if not isinstance(out, dict):
            raise TypeError(f"{type(self.module).__name__}.forward must return dict[str, list[Tensor]]")
        for name, vals in out.items():
            if len(vals) != len(batch):
                raise ValueError(f"{type(self.module).__name__}.forward returned {len(vals)} values for "
                                 f"{name!r}, expected one per request ({len(batch)})")
        self.batch_sizes.append(len(batch))
        return out

    @staticmethod
    def _rows(out: dict[str, list], n: int) -> list[dict]:
        """Per request, its outputs (each a list of values)."""
        if not out:
            return [{} for _ in range(n)]
        names = list(out)
        # one request's value as a list (a list the module made is taken as it is)
        columns = [[as_values(v) for v in vals] for vals in out.values()]
        return [dict(zip(names, row)) for row in zip(*columns)]

    def _forward(self, batch: list[Prepared]) -> list[dict]:
        ei, tensors = self._engine_inputs(batch)
        return self._call(batch, ei, tensors)

    def free_request(self, request_id: str) -> None:
        """Drop the request's state here: the node's (``NodeSubmodule.release``); KV engines add their blocks."""
        release = getattr(self.module, "release", None)  # a NodeSubmodule; duck-typed modules may lack it
        if release is not None:
            release(request_id)

    def export_request(self, request_id: str, free: bool = True) -> dict[str, Any]:
        """This request's state (removed from here unless ``free`` is False); stateless engines hold none."""
        return {}

    def import_request(self, request_id: str, caches: dict[str, Any]) -> None:
        if caches:
            raise ValueError(f"{type(self.module).__name__} holds no KV cache: cannot import one")

    # -- moving a request's state between ranks (a sharded engine also tells its other shards) --------
    def export_migrating(self, request_id: str, dests: list[int], tokens: list[int], keep: bool) -> dict[str, Any]:
        """This request's state, leaving for ranks ``dests`` (one import ``token`` each)."""
        return self.export_request(request_id, free=not keep)

    def import_migrated(self, request_id: str, caches: dict[str, Any], token: int) -> None:
        """Import state sent by ``export_migrating`` under ``token``."""
        self.import_request(request_id, caches)

    def forget(self, request_id: str) -> None:
        """The request is freed for good (after ``free_request``): nothing of it may arrive later."""

    def stats(self) -> dict[str, Any]:
        return {}
