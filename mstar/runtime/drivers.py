"""How the runtime's thread reaches its workers, chosen once when the ``Runtime`` is built.

``InlineDriver``: every rank's ``Worker`` lives in this process and is stepped by the runtime's
thread; messages are handed over as objects. ``ProcessDriver``: one process per rank (``spawn``),
messages over ZeroMQ IPC; it also watches the processes and reports a dead one.

Both offer the same small surface to the runtime loop: ``start`` / ``stop``, ``pump`` (move
messages and run work; returns whether anything happened), ``idle`` (wait a little when nothing
did), ``wake`` (cut that wait short), and ``lost`` (why a worker is gone, set by ``pump``; None
while every worker lives).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

from mstar.runtime.conductor import Conductor
from mstar.runtime.messages import CONDUCTOR, Shutdown, WorkerStatus
from mstar.runtime.process import spawn_workers
from mstar.runtime.routing import Routing
from mstar.runtime.transport import InlineTransport, ZmqTransport
from mstar.runtime.worker import Worker


class InlineDriver:
    """The conductor and every rank's worker on the runtime's thread."""

    processes: list = []  # no worker processes
    lost: str | None = None  # workers of this process cannot be lost

    def __init__(self, model: Any, routing: Routing, device: str) -> None:
        self.transport = InlineTransport()
        self.workers = [Worker(r, model, routing, self.transport, device) for r in range(routing.num_ranks)]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def pump(self, conductor: Conductor, busy: bool) -> bool:
        boxes = self.transport.boxes
        did = False
        while boxes[CONDUCTOR]:
            conductor.handle(boxes[CONDUCTOR].popleft())
            did = True
        for w in self.workers:
            box = boxes[w.rank]
            while box:
                w.handle(box.popleft())
                did = True
        for w in self.workers:
            did = w.step() or did
        return did

    def idle(self) -> None:
        self.transport.wake.wait(0.05)
        self.transport.wake.clear()

    def wake(self) -> None:
        self.transport.wake.set()


class ProcessDriver:
    """One worker process per rank; the runtime's thread only runs the conductor."""

    CHECK_EVERY_S = 0.25  # how often the worker processes are checked for life

    def __init__(self, model: Any, routing: Routing, device: str, start_timeout: float) -> None:
        self.model, self.routing, self.device = model, routing, device
        self.start_timeout = start_timeout
        self.workers: list[Worker] = []  # none in this process
        self.transport: ZmqTransport | None = None
        self.processes: list = []  # one multiprocessing.Process per rank
        self._run_dir: str | None = None
        self._last_check = 0.0
        self.lost: str | None = None

    def start(self) -> None:
        """Spawn the worker processes and wait until each reports ready (or why it could not start)."""
        self._run_dir = tempfile.mkdtemp(prefix="mstar-")
        self.transport = ZmqTransport(self._run_dir, CONDUCTOR)
        self.processes = spawn_workers(self.model, self.routing.placement, self._run_dir, self.device,
                                    self.routing.num_ranks)
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < len(self.processes):
            dead = [p for p in self.processes if not p.is_alive()]
            for msg in self.transport.recv(500 if dead else 100):  # a dead worker's last word first
                if isinstance(msg, WorkerStatus):
                    if not msg.ok:
                        self.stop()
                        raise RuntimeError(f"worker rank {msg.rank} failed to start:\n{msg.error}")
                    ready.add(msg.rank)
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"exited with code {dead[0].exitcode}" if dead else f"not ready in {self.start_timeout} s"
                raise RuntimeError(f"worker process {why}")

    def stop(self) -> None:
        """Ask every live worker to shut down, then make sure each process is gone; sweep shm files."""
        for r, p in enumerate(self.processes):
            if p.is_alive():
                try:
                    self.transport.send(r, Shutdown("runtime shutdown"))
                except Exception:  # noqa: BLE001 - best effort; terminate below
                    pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.processes = []
        if self.transport is not None:
            self.transport.sweep_shm()
            self.transport.close()
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def pump(self, conductor: Conductor, busy: bool) -> bool:
        did = False
        for msg in self.transport.recv(0 if busy else 5):  # the receive's timeout is the idle wait
            conductor.handle(msg)
            did = True
        now = time.monotonic()
        if now - self._last_check >= self.CHECK_EVERY_S:
            self._last_check = now
            self.lost = next((f"worker rank {rank} died (exit code {p.exitcode})"
                              for rank, p in enumerate(self.processes) if not p.is_alive()), None)
        return did

    def idle(self) -> None:
        pass

    def wake(self) -> None:
        pass  # the loop polls its socket with a short timeout and runs commands after it
