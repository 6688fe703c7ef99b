"""Worker processes of one host on the mesh transport: ``Runtime(..., transport="tcp")``.

The same processes, restarts and checks as ``ProcessDriver``; only the data plane differs: every
rank binds IPC and TCP (``MeshTransport``), announces its endpoint, and the conductor hands out the
``AddressBook`` once every rank is ready (again after a restart, which binds a new port). With
``force_tcp`` every link is TCP with tensors inline, so one host exercises the path that ranks on
different nodes take. A rank whose TCP link from the conductor drops is killed and counted as a dead
rank (restarted or given up on as the policy says).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import uuid
from typing import Any

from mstar.runtime.drivers.local import ProcessDriver
from mstar.runtime.drivers.mesh_worker import MeshJoin, serve_rank
from mstar.runtime.wire.address_book import AddressBook
from mstar.runtime.wire.mesh_transport import MeshTransport, node_host
from mstar.runtime.wire.messages import CONDUCTOR, WorkerStatus

log = logging.getLogger("mstar.runtime")

LOCAL_NODE = "local"  # every process of this driver shares the host


def _process_main(rank: int, model: Any, placement: Any, device: str, join: MeshJoin, parent_pid: int) -> None:
    serve_rank(rank, model, placement, device, join, orphaned=lambda: os.getppid() != parent_pid)


def broadcast_book(transport: MeshTransport, ranks: range) -> AddressBook:
    """Send every rank the endpoints announced so far (a new version of the book)."""
    entries = {CONDUCTOR: transport.endpoint, **transport.hellos}
    book = AddressBook(entries, transport.book.version + 1)
    transport.install(book)
    for rank in ranks:
        transport.send(rank, book)
    return book


class MeshProcessDriver(ProcessDriver):
    """``ProcessDriver`` whose workers talk over ``MeshTransport`` (TCP between every pair with
    ``force_tcp``)."""

    def __init__(self, *args: Any, force_tcp: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.force_tcp = force_tcp
        self._join: MeshJoin | None = None

    def _open_transport(self) -> MeshTransport:
        run_id = f"mstar-{uuid.uuid4().hex[:12]}"
        host = node_host()
        transport = MeshTransport(self._run_dir, CONDUCTOR, LOCAL_NODE, host, run_id, self.force_tcp)
        transport.install(AddressBook({CONDUCTOR: transport.endpoint}))
        self._join = MeshJoin(run_id, transport.endpoint, LOCAL_NODE, host, self.force_tcp)
        return transport

    def _spawn(self, rank: int) -> Any:
        args = (rank, self.model, self.routing.placement, self.device, self._join, os.getpid())
        p = mp.get_context("spawn").Process(target=_process_main, args=args, name=f"mstar-worker-{rank}",
                                            daemon=True)
        p.start()
        return p

    def _started(self) -> None:
        broadcast_book(self.transport, range(self.routing.num_ranks))

    def _replacement_ready(self, msg: WorkerStatus) -> None:
        if msg.ok and msg.rank in self._starting:  # its new endpoint came first (same socket, FIFO)
            broadcast_book(self.transport, range(self.routing.num_ranks))
        super()._replacement_ready(msg)

    def _watch(self, conductor: Any, now: float) -> None:
        for rank in sorted(self.transport.lost_peers()):
            p = self.processes[rank] if 0 <= rank < len(self.processes) else None
            if p is not None and rank not in self._starting and p.is_alive():
                log.error("worker rank %d: TCP connection lost; counting it as dead", rank)
                p.kill()
                p.join(5)
        super()._watch(conductor, now)
