"""A stateless engine's steady path for the rows of a self-loop (a code predictor's steps): a forward
of a module that can continue its batch (``NodeSubmodule.continue_batch``) is kept, and ``run_rows``
runs the next iterations of its rows from it without ``prepare_inputs`` or per-item planning, for
the worker's running rows (``runtime/running_rows.py``). ``KVRows`` (``kv/rows.py``)
is the same path for a KV engine's decode rows, with their cache slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.model.submodule import EngineInputs, NodeSubmodule
from mstar.runtime.engine import StatelessEngine
from mstar.runtime.kv.rows import next_inputs, rows_in, select_rows
from mstar.runtime.work_items import Prepared, WorkItem

__all__ = ["StatelessRowsEngine"]


@dataclass(slots=True)
class _KeptForward:
    """The last forward, when its module can continue the batch."""

    items: list[WorkItem]  # one per row
    walk: str | None  # the walk it ran for (None: several)
    ei: EngineInputs
    tensors: dict[str, torch.Tensor]
    outputs: dict[str, list]  # what the module returned


class StatelessRowsEngine(StatelessEngine):
    """A ``StatelessEngine`` whose forwards' rows may go on as running rows (module docstring)."""

    continues_batches = True

    def __init__(self, module: NodeSubmodule) -> None:
        super().__init__(module)
        self._kept: _KeptForward | None = None
        self._continues = type(module).continue_batch is not NodeSubmodule.continue_batch
        self.row_forwards = 0  # forwards made by ``run_rows``

    def rows_of(self, items: list[WorkItem]) -> tuple[list[int], dict[str, list]] | None:
        """Each item's row in the last forward and that forward's outputs, when every item ran in it
        and its module can continue the batch; else None."""
        return rows_in(self._kept, items)

    def run(self, items: list[WorkItem]) -> list:
        self._kept = None
        return super().run(items)

    def _forward(self, batch: list[Prepared]) -> list[dict]:
        ei, tensors = self._engine_inputs(batch)
        walks = set(ei.walks)
        walk = walks.pop() if len(walks) == 1 else None
        out = self._call_raw(batch, ei, tensors, walk)
        if self._continues:  # (items isolated after a failure: the last one's forward is kept, alone)
            self._kept = _KeptForward([p.item for p in batch], walk, ei, tensors, out)
        return self._rows(out, len(batch))

    def run_rows(self, items: list[WorkItem], rows: list[int]) -> dict[str, list] | None:
        """One forward of ``items``, the next iterations of the last forward's ``rows``
        (``rows_of``), their inputs from the module's ``continue_batch``. The module's outputs
        as it returned them; None, with nothing changed, when the module declines or the forward
        fails: ``run`` then prepares the items."""
        last, self._kept = self._kept, None
        if last is None:
            return None
        nxt = next_inputs(self.module, last)
        if nxt is None:
            return None
        tensors, args = nxt
        n, prev = len(rows), last.ei
        ones = [1] * n
        if n == len(last.items) and rows[-1] == n - 1:  # every row goes on (rows ascend): the lists stay
            ei, infos = prev, prev.infos
            ei.args, ei.splits = args, {k: ones for k in tensors}
        else:
            tensors, args = select_rows(rows, tensors, args)
            infos = [prev.infos[r] for r in rows]
            ei = EngineInputs(walks=[it.walk for it in items], nodes=[it.node for it in items],
                              request_ids=[it.request_id for it in items], infos=infos,
                              splits={k: ones for k in tensors}, args=args)
        for info, item in zip(infos, items):  # each row's ForwardInfo, brought up to date
            info.iteration = item.iteration
        try:
            out = self._call_raw(items, ei, tensors, last.walk)
        except Exception:  # noqa: BLE001 - run's general path retries and isolates the failure
            return None
        self._kept = _KeptForward(items, last.walk, ei, tensors, out)
        self.row_forwards += 1
        return out
