"""How the runtime's thread reaches its workers, chosen once when the ``Runtime`` is built.

``InlineDriver``: every rank's ``Worker`` lives in this process and is stepped by the runtime's
thread; messages are handed over as objects. ``ProcessDriver``: one process per rank (``spawn``),
messages over ZeroMQ IPC; it also watches the processes and reports a dead one.

Both offer the same small surface to the runtime loop: ``start`` / ``stop``, ``pump`` (move
messages and run work; returns whether anything happened), ``idle`` (wait a little when nothing
did), ``wake`` (cut that wait short), and ``lost`` (why a worker is gone, set by ``pump``; None
while every worker lives). A ``ProcessDriver`` respawns a dead rank as its ``RestartPolicy``
allows: ``lost`` then holds ``restarting: ...`` until the new process reports ready, and
``gave_up`` is set once the policy refuses (``lost`` stays set for good).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections import deque
from typing import Any

from mstar.runtime.conductor import Conductor
from mstar.runtime.drivers.process import spawn_worker
from mstar.runtime.handles import held_wakeups
from mstar.runtime.routing import Routing
from mstar.runtime.tp.groups import NO_RESTART, open_rendezvous
from mstar.runtime.wire.messages import CONDUCTOR, FreeRequest, Shutdown, WorkerStatus
from mstar.runtime.wire.transport import InlineTransport, ZmqTransport
from mstar.runtime.worker import Worker

log = logging.getLogger("mstar.runtime")

ON_WORKER_DEATH = ("restart", "exit")


class RestartPolicy:
    """Whether a dead worker process is respawned: never with ``exit``; with ``restart`` unless
    ``max_restarts`` restarts already happened in the last ``window_s`` seconds."""

    def __init__(self, on_death: str = "restart", max_restarts: int = 3, window_s: float = 300.0) -> None:
        if on_death not in ON_WORKER_DEATH:
            raise ValueError(f"on_worker_death must be one of {ON_WORKER_DEATH}, got {on_death!r}")
        if max_restarts < 0 or window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and restart_window_s > 0")
        self.on_death, self.max_restarts, self.window_s = on_death, max_restarts, window_s
        self._deaths: deque[float] = deque()

    def allow(self, now: float) -> str | None:
        """A death at ``now``: None if it may be restarted (the restart is counted), else why not."""
        if self.on_death == "exit":
            return "on_worker_death is 'exit'"
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.max_restarts:
            return f"{self.max_restarts} restart(s) already in the last {self.window_s:g} s"
        self._deaths.append(now)
        return None


class InlineDriver:
    """The conductor and every rank's worker on the runtime's thread."""

    processes: list = []  # no worker processes
    lost: str | None = None  # workers of this process cannot be lost
    gave_up: str | None = None

    def __init__(self, model: Any, routing: Routing, device: str) -> None:
        self.transport = InlineTransport()
        self.workers = [Worker(r, model, routing, self.transport, device) for r in range(routing.num_ranks)]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def pump(self, conductor: Conductor, busy: bool) -> bool:
        """Deliver messages until none is left (a hand-off between partitions goes worker ->
        conductor -> worker within one pump, so the next step can already run its new walk), then
        one step per worker."""
        boxes = self.transport.boxes
        did, moved = False, True
        with held_wakeups():  # one wake-up per consumer loop for the whole pass (handles.py)
            while moved:
                moved = False
                while boxes[CONDUCTOR]:
                    conductor.handle(boxes[CONDUCTOR].popleft())
                    moved = True
                for w in self.workers:
                    box = boxes[w.rank]
                    while box:
                        w.handle(box.popleft())
                        moved = True
                did = did or moved
        for w in self.workers:
            did = w.step() or did
        return did

    def idle(self) -> None:
        self.transport.wake.wait(0.05)
        self.transport.wake.clear()

    def wake(self) -> None:
        self.transport.wake.set()


class ProcessDriver:
    """One worker process per rank; the runtime's thread only runs the conductor.

    A rank whose process dies is respawned (same rank and placement, its modules rebuilt) when the
    policy allows; until the new process reports ``WorkerStatus`` ``lost`` says ``restarting``.
    Every request in flight at the death is freed again on the new process once it is ready:
    messages queued for the dead one (ZeroMQ delivers them to the new bind) allocate nothing that
    outlives them.
    """

    CHECK_EVERY_S = 0.25  # how often the worker processes are checked for life

    def __init__(self, model: Any, routing: Routing, device: str, start_timeout: float,
                 policy: RestartPolicy | None = None) -> None:
        self.model, self.routing, self.device = model, routing, device
        self.start_timeout = start_timeout
        self.policy = policy or RestartPolicy()
        self.workers: list[Worker] = []  # none in this process
        self.transport: ZmqTransport | None = None
        self.processes: list = []  # one multiprocessing.Process per rank
        self._run_dir: str | None = None
        self._last_check = 0.0
        self.lost: str | None = None
        self.gave_up: str | None = None  # why no rank will be restarted any more (``lost`` stays set)
        self._starting: dict[int, float] = {}  # rank -> when its replacement process was spawned
        self._orphans: set[str] = set()  # requests in flight while a rank was down
        self._start_errors: dict[int, str] = {}  # rank -> why its replacement could not build its modules
        self._rendezvous = None  # where tensor-parallel ranks meet (None without TP)

    def start(self) -> None:
        """Spawn the worker processes and wait until each reports ready (or why it could not start)."""
        self._run_dir = tempfile.mkdtemp(prefix="mstar-")
        self.transport = self._open_transport()
        self._rendezvous = open_rendezvous(self.routing.placement)
        self.processes = [self._spawn(rank) for rank in range(self.routing.num_ranks)]
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < len(self.processes):
            dead = [p for p in self.processes if not p.is_alive()]
            for msg in self.transport.recv(500 if dead else 100):  # a dead worker's last word first
                if isinstance(msg, WorkerStatus):
                    if not msg.ok:
                        self.stop()
                        raise RuntimeError(f"worker rank {msg.rank} failed to start:\n{msg.error}")
                    log.info("worker rank %d ready: weights in memory %.1f MiB", msg.rank, msg.weight_bytes / 2**20)
                    ready.add(msg.rank)
            if dead or time.monotonic() > deadline:
                self.stop()
                why = f"exited with code {dead[0].exitcode}" if dead else f"not ready in {self.start_timeout} s"
                raise RuntimeError(f"worker process {why}")
        self._started()

    # hooks of a driver whose workers reach each other differently (``mesh.py``)
    def _open_transport(self) -> ZmqTransport:
        return ZmqTransport(self._run_dir, CONDUCTOR)

    def _spawn(self, rank: int) -> Any:
        address = self._rendezvous.address if self._rendezvous is not None else None
        return spawn_worker(rank, self.model, self.routing.placement, self._run_dir, self.device, address)

    def _started(self) -> None:
        """Every worker reported ready (``start``)."""

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
        self._starting.clear()
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
        if self.transport is not None:
            self.transport.sweep_shm()
            self.transport.close()
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def pump(self, conductor: Conductor, busy: bool) -> bool:
        did = False
        with held_wakeups():  # one wake-up per consumer loop for what this receive brought (handles.py)
            for msg in self.transport.recv(0 if busy else 5):  # the receive's timeout is the idle wait
                if isinstance(msg, WorkerStatus):
                    self._replacement_ready(msg)
                else:
                    conductor.handle(msg)
                did = True
        if self._starting:
            self._orphans.update(conductor.requests)  # the runtime fails them while a rank is down
        now = time.monotonic()
        if self.gave_up is None and now - self._last_check >= self.CHECK_EVERY_S:
            self._last_check = now
            self._watch(conductor, now)
        return did

    def _watch(self, conductor: Conductor, now: float) -> None:
        """Respawn a dead rank, or give up (as the policy says); a replacement that never gets
        ready is given up on too."""
        for rank, p in enumerate(self.processes):
            if rank in self._starting and p.is_alive() and now - self._starting[rank] > self.start_timeout:
                p.kill()
                p.join(5)
                self._give_up(f"worker rank {rank} was restarted but not ready in {self.start_timeout:g} s")
                return
            if p.is_alive():
                continue
            error = self._start_errors.pop(rank, None)
            why = (f"worker rank {rank} could not restart ({error})" if error
                   else f"worker rank {rank} died (exit code {p.exitcode})")
            refusal = NO_RESTART if self._rendezvous is not None else self.policy.allow(now)
            if refusal is not None:
                self._give_up(f"{why}; not restarted: {refusal}")
                return
            log.warning("%s; restarting it", why)
            self.transport.sweep_shm(rank)  # frames queued for it: lost with it, or dropped by the new one
            self._orphans.update(conductor.requests)
            self.processes[rank] = self._spawn(rank)
            self._starting[rank] = now
            self.lost = f"restarting: {why}"

    def _give_up(self, why: str) -> None:
        log.error("%s: the runtime cannot serve any more", why)
        self.gave_up = self.lost = why
        self._starting.clear()
        self._orphans.clear()

    def _replacement_ready(self, msg: WorkerStatus) -> None:
        if msg.rank not in self._starting:
            return
        if not msg.ok:  # its process exits: the next check counts another death
            log.error("worker rank %d failed to restart:\n%s", msg.rank, msg.error)
            self._start_errors[msg.rank] = (msg.error.strip().splitlines() or ["unknown error"])[-1]
            return
        del self._starting[msg.rank]
        self._start_errors.pop(msg.rank, None)
        for rid in self._orphans:  # whatever reached the new process for them is dropped
            self.transport.send(msg.rank, FreeRequest(rid))
        if not self._starting:
            self._orphans.clear()
            self.lost = None
            log.warning("worker rank %d restarted: serving again", msg.rank)

    def idle(self) -> None:
        pass

    def wake(self) -> None:
        self.transport.interrupt()  # the loop's receive returns: it runs the command at once
