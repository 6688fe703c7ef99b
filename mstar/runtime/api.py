"""``Runtime``: the public entry point.

    with Runtime("orpheus-tiny") as rt:
        outs = rt.generate([inputs_a, inputs_b], params)   # blocking, input order kept
        h = rt.submit(inputs, params)                      # returns at once
        for item in h: ...                                 # streamed EMIT_TO_CLIENT items
        rt.abort(h.request_id)
        rt.stats()

Inline mode runs the conductor and every rank's worker in one background thread of this process
(fast, for tests and laptops); process mode (``workers="process"``) runs one process per rank.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.model.base import ModelDef
from mstar.model.registry import resolve_model
from mstar.placement import Placement
from mstar.runtime.conductor import Conductor, RequestStatus
from mstar.runtime.messages import CONDUCTOR, Emit, Shutdown, StatsRequest, WorkerStatus
from mstar.runtime.process import spawn_workers
from mstar.runtime.routing import Routing
from mstar.runtime.transport import InlineTransport, ZmqTransport
from mstar.runtime.worker import Worker


class RequestError(RuntimeError):
    """Raised while iterating a request that failed."""


@dataclass(frozen=True)
class StreamItem:
    name: str
    value: list[torch.Tensor]
    modality: str | None
    node: str
    walk: str


@dataclass
class RequestOutput:
    request_id: str
    status: RequestStatus
    error: str | None = None
    outputs: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)  # edge name -> emitted values

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tensors(self, name: str) -> list[torch.Tensor]:
        """Every tensor emitted on ``name``, flattened in emission order."""
        return [t for value in self.outputs.get(name, []) for t in value]


class RequestHandle:
    """A submitted request: iterate it (sync or async) for its streamed items.

    Items also accumulate in ``result().outputs``. Async iteration binds the handle to the running
    event loop: the driver thread then hands items over with ``call_soon_threadsafe`` (no thread
    per waiting request).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._events: queue.Queue = queue.Queue()
        self._output = RequestOutput(request_id, RequestStatus.WAITING)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue | None = None

    def _sink(self, kind: str, payload: Any) -> None:  # called on the driver thread
        if kind == "item":
            msg: Emit = payload
            self._output.outputs.setdefault(msg.name, []).append(msg.value)
            ev = StreamItem(msg.name, msg.value, msg.modality, msg.node, msg.walk)
        else:
            self._output.status, self._output.error = payload
            self._done.set()
            ev = None
        with self._lock:
            if self._aqueue is not None:
                try:
                    self._loop.call_soon_threadsafe(self._aqueue.put_nowait, ev)
                except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                    pass
            else:
                self._events.put(ev)

    def _end_of_stream(self) -> None:
        if self._output.status is RequestStatus.FAILED:
            raise RequestError(f"request {self.request_id} failed: {self._output.error}")

    def __iter__(self) -> Iterator[StreamItem]:
        if self._aqueue is not None:
            raise RuntimeError("this handle is being iterated asynchronously")
        while True:
            ev = self._events.get()
            if ev is None:
                self._events.put(None)  # later iterations end at once too
                self._end_of_stream()
                return
            yield ev

    async def __aiter__(self):
        with self._lock:
            if self._aqueue is None:
                self._loop = asyncio.get_running_loop()
                self._aqueue = asyncio.Queue()
                while not self._events.empty():
                    self._aqueue.put_nowait(self._events.get_nowait())
        while True:
            ev = await self._aqueue.get()
            if ev is None:
                self._aqueue.put_nowait(None)
                self._end_of_stream()
                return
            yield ev

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._output

    @property
    def done(self) -> bool:
        return self._done.is_set()


class Runtime:
    def __init__(self, model: str | ModelDef | type, placement: str | Path | Placement | None = None, *,
                 workers: str = "inline", device: str = "cpu", model_kwargs: Mapping[str, Any] | None = None,
                 start_timeout: float = 300.0) -> None:
        if workers not in ("inline", "process"):
            raise ValueError(f"workers must be 'inline' or 'process', got {workers!r}")
        self.model = resolve_model(model, **(model_kwargs or {}))
        graph = self.model.graph
        if placement is None:
            placement = Placement.single_rank(graph, model=self.model.name)
        elif isinstance(placement, (str, Path)):
            placement = Placement.load(placement)
        self.placement = placement.check_model(self.model.name, self.model.family).validate(graph)
        self.model.preflight()
        self.routing = Routing(graph, self.placement)
        self.mode = workers
        self.device = device
        self.start_timeout = start_timeout
        self._procs: list = []
        self._run_dir: str | None = None
        self._workers: list[Worker] = []
        if workers == "inline":
            self._transport: Any = InlineTransport()
            self._workers = [Worker(r, self.model, self.routing, self._transport, device)
                             for r in range(self.routing.num_ranks)]
        self._conductor: Conductor | None = None
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._lost: str | None = None  # set when a worker process died
        self._tokens = itertools.count()
        self._pollers: list = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Runtime:
        if self._thread is not None:
            return self
        if self.mode == "process":
            self._start_processes()
        else:
            self._conductor = Conductor(self.model, self.routing, self._transport)
        self._stop = False
        self._thread = threading.Thread(target=self._drive, name="mstar-runtime", daemon=True)
        self._thread.start()
        return self

    def _start_processes(self) -> None:
        self._run_dir = tempfile.mkdtemp(prefix="mstar-")
        self._transport = ZmqTransport(self._run_dir, CONDUCTOR)
        self._conductor = Conductor(self.model, self.routing, self._transport)
        self._procs = spawn_workers(self.model, self.placement, self._run_dir, self.device, self.routing.num_ranks)
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < len(self._procs):
            dead = [p for p in self._procs if not p.is_alive()]
            for msg in self._transport.recv(500 if dead else 100):  # a dead worker's last word first
                if isinstance(msg, WorkerStatus):
                    if not msg.ok:
                        self._stop_processes()
                        raise RuntimeError(f"worker rank {msg.rank} failed to start:\n{msg.error}")
                    ready.add(msg.rank)
            if dead or time.monotonic() > deadline:
                self._stop_processes()
                why = f"exited with code {dead[0].exitcode}" if dead else f"not ready in {self.start_timeout} s"
                raise RuntimeError(f"worker process {why}")

    def _stop_processes(self) -> None:
        for r, p in enumerate(self._procs):
            if p.is_alive():
                try:
                    self._transport.send(r, Shutdown("runtime shutdown"))
                except Exception:  # noqa: BLE001 - best effort; terminate below
                    pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._procs = []
        if isinstance(self._transport, ZmqTransport):
            self._transport.sweep_shm()
            self._transport.close()
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def shutdown(self) -> None:
        """Abort what is in flight, stop the workers (processes exit, nothing is orphaned)."""
        if self._thread is not None:
            self._stop = True
            self._wake()
            self._thread.join()
            self._thread = None
            if self.mode == "process":
                self._stop_processes()

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Validate and submit one request; returns at once. Bad input raises ValueError here."""
        if self._thread is None:
            raise RuntimeError("runtime is not started: use `with Runtime(...) as rt:` or rt.start()")
        if self._lost:
            raise RuntimeError(f"runtime is unhealthy: {self._lost}")
        params = dict(params or {})
        norm = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in inputs.items()}
        self.model.validate_request(norm, params)
        handle = RequestHandle(request_id or uuid.uuid4().hex[:16])
        self._command(lambda: self._conductor.submit(handle.request_id, norm, params, handle._sink))
        return handle

    def generate(self, inputs: list[Mapping[str, Any]] | Mapping[str, Any],
                 params: Mapping[str, Any] | list[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Submit every request, wait for all; outputs in input order."""
        batch = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        plist = params if isinstance(params, list) else [params] * len(batch)
        handles = [self.submit(i, p) for i, p in zip(batch, plist)]
        return [h.result() for h in handles]

    def abort(self, request_id: str) -> None:
        self._command(lambda: self._conductor.abort(request_id))

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """KV blocks used/free, queue depths and per-node batch-size histograms, per rank."""
        token = next(self._tokens)
        done = threading.Event()

        def ask():
            for r in range(self.routing.num_ranks):
                self._transport.send(r, StatsRequest(token))

        self._command(ask)
        result: dict[str, Any] = {}

        def collect():
            replies = self._conductor.stats_replies.get(token, {})
            if len(replies) == self.routing.num_ranks:
                result["ranks"] = [replies[r] for r in sorted(replies)]
                result["running_requests"] = self._conductor.num_running()
                del self._conductor.stats_replies[token]
                done.set()
                return True
            return False

        self._command(lambda: self._pollers.append(collect))
        if not done.wait(timeout):
            raise TimeoutError("stats did not arrive")
        return result

    # -- driver --------------------------------------------------------------------------------
    def _command(self, fn) -> None:
        self._commands.put(fn)
        self._wake()

    def _wake(self) -> None:
        if self.mode == "inline":
            self._transport.wake.set()
        # process mode: the driver polls its socket with a short timeout and checks commands after it

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._lost is None

    def _drive(self) -> None:
        conductor = self._conductor
        last_check = time.monotonic()
        try:
            while not self._stop:
                did = False
                while not self._commands.empty():
                    self._commands.get()()
                    did = True
                if self.mode == "inline":
                    did = self._pump_inline(conductor) or did
                else:
                    for msg in self._transport.recv(0 if did else 5):
                        conductor.handle(msg)
                        did = True
                    if time.monotonic() - last_check > 0.25:
                        last_check = time.monotonic()
                        self._check_workers(conductor)
                if self._pollers:
                    self._pollers = [p for p in self._pollers if not p()]
                if not did and self.mode == "inline":
                    self._transport.wake.wait(0.05)
                    self._transport.wake.clear()
            # shutting down: whatever is still in flight ends as aborted, so no caller waits forever
            while not self._commands.empty():
                self._commands.get()()
            for rid in list(conductor.requests):
                conductor.abort(rid)
        except BaseException as e:  # noqa: BLE001 - surface runtime bugs to every waiting request
            self._lost = f"runtime error: {type(e).__name__}: {e}"
            for rid in list(conductor.requests):
                conductor.fail(rid, self._lost)
            raise

    def _pump_inline(self, conductor: Conductor) -> bool:
        boxes = self._transport.boxes
        did = False
        while boxes[CONDUCTOR]:
            conductor.handle(boxes[CONDUCTOR].popleft())
            did = True
        for w in self._workers:
            box = boxes[w.rank]
            while box:
                w.handle(box.popleft())
                did = True
        for w in self._workers:
            did = w.step() or did
        return did

    def _check_workers(self, conductor: Conductor) -> None:
        for rank, p in enumerate(self._procs):
            if not p.is_alive() and self._lost is None:
                self._lost = f"worker rank {rank} died (exit code {p.exitcode})"
        if self._lost:
            for rid in list(conductor.requests):
                conductor.fail(rid, self._lost)
