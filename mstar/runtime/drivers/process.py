"""Worker processes: one per rank, started with the ``spawn`` method (safe with threads and torch).

A worker process builds its rank's submodules, reports ``WorkerStatus``, then loops: receive
messages -> handle them -> run one batched forward; it waits on its socket when idle (no busy
loop) and exits when told to shut down or when its parent process is gone (no orphans).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from mstar.runtime.gc_freeze import freeze_startup_objects
from mstar.runtime.malloc import keep_freed_memory
from mstar.runtime.wire.messages import CONDUCTOR, WorkerStatus


def set_rank_threads(placement: Any, rank: int) -> None:
    """The rank's intra-op threads: its groups' ``threads``, else torch's default (every core)."""
    torch.set_num_threads(placement.threads_of(rank) or max(1, torch.get_num_threads()))


def worker_main(rank: int, model: Any, placement: Any, run_dir: str, device: str, parent_pid: int,
                dist_address: str | None = None) -> None:
    set_rank_threads(placement, rank)
    from mstar.runtime.routing import Routing
    from mstar.runtime.tp.groups import connect
    from mstar.runtime.wire.transport import ZmqTransport
    from mstar.runtime.worker import Worker

    transport = ZmqTransport(run_dir, rank)

    def make_worker() -> Worker:
        tp = connect(model, placement, rank, dist_address, device)  # None without tensor parallelism
        return Worker(rank, model, Routing(model.graph, placement), transport, device, tp)

    run_rank(rank, make_worker, transport, lambda: os.getppid() != parent_pid)  # the serving process died


def weights_held(worker: Any) -> int:
    """Bytes the weights of a worker's modules hold in memory (each module once)."""
    from mstar.layers.prepack import held_weight_bytes

    modules = {id(e.module): e.module for e in worker.engines.values() if isinstance(getattr(e, "module", None),
                                                                                 torch.nn.Module)}
    return held_weight_bytes(*modules.values())


def run_rank(rank: int, make_worker: Callable[[], Any], transport: Any, orphaned: Callable[[], bool],
             cleanup: Callable[[], None] | None = None) -> None:
    """A rank's life: build its worker and report whether that worked (with the traceback if not),
    then ``serve`` until shutdown; after serving, ``cleanup()`` runs, and the transport is closed
    at the end either way."""
    keep_freed_memory()  # a step's large buffers are reused, not mapped and zeroed anew (malloc.py)
    try:
        worker = make_worker()
    except Exception:  # noqa: BLE001 - report why this rank could not start
        transport.send(CONDUCTOR, WorkerStatus(rank, False, traceback.format_exc()))
        transport.close(linger_ms=5000)  # the reason must reach the conductor before this rank ends
        return
    freeze_startup_objects()  # full collections skip the model and the libraries (gc_freeze.py)
    transport.send(CONDUCTOR, WorkerStatus(rank, True, weight_bytes=weights_held(worker)))
    try:
        serve(worker, transport, orphaned)
    finally:
        if cleanup is not None:
            cleanup()
        transport.close()


def serve(worker: Any, transport: Any, orphaned: Callable[[], bool]) -> None:
    """A ready rank's loop: receive -> handle -> one batched step; waits on its socket when idle
    and returns at ``Shutdown``, or when ``orphaned()`` says so while idle."""
    busy = False
    with torch.inference_mode():  # entered once, not around every forward
        while worker.running:
            for msg in transport.recv(0 if busy else 50):
                worker.handle(msg)
            busy = worker.step()
            if not busy and orphaned():
                break


def spawn_worker(rank: int, model: Any, placement: Any, run_dir: str, device: str,
                 dist_address: str | None = None) -> Any:
    """Start the process of one rank (also a replacement for a dead one: it binds the same address).
    ``dist_address``: where the ranks meet for tensor parallelism (None without it)."""
    args = (rank, model, placement, run_dir, device, os.getpid(), dist_address)
    p = mp.get_context("spawn").Process(target=worker_main, args=args, name=f"mstar-worker-{rank}", daemon=True)
    p.start()
    return p

