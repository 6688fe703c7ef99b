"""``Runtime``: the public entry point.

    with Runtime("orpheus-tiny") as rt:
        outs = rt.generate([inputs_a, inputs_b], params)   # blocking, input order kept
        h = rt.submit(inputs, params)                      # returns at once
        for item in h: ...                                 # streamed EMIT_TO_CLIENT items
        rt.abort(h.request_id)
        rt.stats()

Inline mode runs the conductor and every rank's worker in one background thread of this process
(fast, for tests and laptops); process mode (``workers="process"``) runs one process per rank;
``workers="ray"`` one Ray actor per rank, possibly on several hosts.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mstar.model.base import ModelDef
from mstar.model.reads import ReadDict
from mstar.model.registry import resolve_model
from mstar.model.request import ModelRequest
from mstar.placement import Placement
from mstar.runtime.conductor import Conductor
from mstar.runtime.drivers.local import InlineDriver, ProcessDriver, RestartPolicy
from mstar.runtime.engine import StatelessEngine
from mstar.runtime.gc_freeze import freeze_startup_objects, thaw
from mstar.runtime.handles import RequestHandle, RequestOutput
from mstar.runtime.malloc import keep_freed_memory
from mstar.runtime.openmp import release_thread_pool
from mstar.runtime.routing import Routing
from mstar.runtime.runtime_loop import RuntimeLoop
from mstar.runtime.tp.groups import check_tp_placement, tp_rank_tuples

WORKER_MODES = ("inline", "process", "ray")


def _make_driver(workers: str, transport: str, model: ModelDef, routing: Routing, device: str,
                 start_timeout: float, policy: RestartPolicy, ray_address: str | None) -> Any:
    if workers == "inline":
        return InlineDriver(model, routing, device)
    if workers == "ray":
        from mstar.runtime.drivers.ray import RayDriver  # Ray is optional: imported only here

        return RayDriver(model, routing, device, start_timeout, address=ray_address)
    if transport == "tcp":
        from mstar.runtime.drivers.mesh import MeshProcessDriver

        return MeshProcessDriver(model, routing, device, start_timeout, policy, force_tcp=True)
    return ProcessDriver(model, routing, device, start_timeout, policy)


class Runtime:
    def __init__(self, model: str | ModelDef | type, placement: str | Path | Placement | None = None, *,
                 workers: str = "inline", device: str = "cpu", model_kwargs: Mapping[str, Any] | None = None,
                 start_timeout: float = 300.0, kv_cache_memory_gib: float | None = None,
                 on_worker_death: str = "restart", max_restarts: int = 3, restart_window_s: float = 300.0,
                 prefix_caching: bool | None = None, transport: str = "auto",
                 ray_address: str | None = None, trace_requests: int | None = None) -> None:
        """``on_worker_death`` (process mode): ``restart`` respawns a dead worker's rank, unless
        ``max_restarts`` restarts already happened within ``restart_window_s``; then, or at once
        with ``exit``, the runtime stays unhealthy for good (``fatal``).

        ``kv_cache_memory_gib``: size every KV pool from memory (replaces the placement's
        ``kv_cache_blocks`` / ``kv_cache_memory_gib``; ``mstar serve --kv-cache-memory``).
        ``prefix_caching``: True / False replaces the placement's ``runtime.prefix_caching`` (default
        on; ``mstar serve --no-prefix-caching``).
        ``trace_requests``: replaces the placement's ``runtime.trace_requests`` (how many of the
        latest requests' traces ``trace`` finds; 0: none; ``mstar serve --trace-requests``).

        ``workers="ray"``: one Ray actor per rank (``drivers/ray.py``), on the Ray cluster at
        ``ray_address`` (None: the one this process is connected to, else a new local one); ranks
        are not restarted there, so the first death is fatal whatever ``on_worker_death`` says.
        ``transport="tcp"`` (process mode): every link between processes over TCP, tensors inline,
        as between ranks on different nodes."""
        if workers not in WORKER_MODES:
            raise ValueError(f"workers must be one of {WORKER_MODES}, got {workers!r}")
        if ray_address is not None and workers != "ray":
            raise ValueError("ray_address needs workers='ray'")
        if transport not in ("auto", "tcp") or (transport == "tcp" and workers != "process"):
            raise ValueError(f"transport must be 'auto', or 'tcp' with workers='process', got {transport!r}")
        self.model = resolve_model(model, **(model_kwargs or {}))
        graph = self.model.graph
        if placement is None:
            placement = Placement.single_rank(graph, model=self.model.name)
        elif isinstance(placement, (str, Path)):
            placement = Placement.load(placement)
        self.placement = placement.check_model(self.model.name, self.model.family).validate(graph)
        overrides = {k: v for k, v in (("kv_cache_memory_gib", kv_cache_memory_gib),
                                       ("prefix_caching", prefix_caching), ("trace_requests", trace_requests))
                     if v is not None}
        if overrides:
            limits = dataclasses.replace(self.placement.limits, **overrides)
            self.placement = dataclasses.replace(self.placement, limits=limits)
        check_tp_placement(self.model, self.placement)
        if tp_rank_tuples(self.placement) and (workers != "process" or transport != "auto"):
            raise ValueError("tensor parallelism (tp_size > 1) runs on worker processes of one host for now: "
                             "use workers='process' (not inline or ray, nor transport='tcp')")
        self.model.preflight()
        self.routing = Routing(graph, self.placement)
        self.mode = workers
        self.device = device
        policy = RestartPolicy(on_worker_death, max_restarts, restart_window_s)  # checked in either mode
        # chosen once: the loop below never asks which mode it is in
        self._driver = _make_driver(workers, transport, self.model, self.routing, device, start_timeout, policy,
                                    ray_address)
        self._loop = RuntimeLoop(self._driver)
        self._conductor: Conductor | None = None
        self._thread: threading.Thread | None = None
        self._pool_blocks: dict[str, int] = {}  # KV module -> blocks of its smallest pool, when sized from memory

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Runtime:
        if self._thread is not None:
            return self
        self._driver.start()
        self._conductor = Conductor(self.model, self.routing, self._driver.transport)
        release_thread_pool()  # this thread's OpenMP workers would throttle the runtime's (openmp.py)
        keep_freed_memory()  # a step's large buffers are reused, not mapped and zeroed anew (malloc.py)
        freeze_startup_objects()  # full collections skip what was built so far (gc_freeze.py)
        self._thread = self._loop.start(self._conductor)
        # a runtime still running when the interpreter exits is shut down first: a daemon thread
        # caught inside a torch op by the interpreter's finalization aborts the process
        ref = weakref.ref(self)
        self._exit_hook = lambda: (rt := ref()) is not None and rt.shutdown()
        atexit.register(self._exit_hook)
        if self.placement.limits.kv_cache_memory_gib is not None:  # each module's pool size is known now
            for r in self.stats()["ranks"]:
                for module, kv in r["kv"].items():
                    self._pool_blocks[module] = min(self._pool_blocks.get(module, kv["blocks_total"]),
                                                    kv["blocks_total"])
        return self

    def shutdown(self) -> None:
        """Abort what is in flight, stop the workers (processes exit, nothing is orphaned)."""
        if self._thread is not None:
            self._loop.stop()
            self._thread = None
            self._driver.stop()
            atexit.unregister(self._exit_hook)
            thaw()  # what this runtime held is collectable again (gc_freeze.py)

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the runtime cannot serve (a worker died, a runtime error), or None."""
        return self._loop.lost or self._driver.lost

    @property
    def fatal(self) -> str | None:
        """Why the runtime will never serve again (a runtime error, a worker death not restarted), or
        None while it serves or may again (``mstar serve`` exits non-zero on it)."""
        return self._loop.lost or self._driver.gave_up

    # -- requests ------------------------------------------------------------------------------
    def submit(self, inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None,
               request_id: str | None = None, trace: bool = True) -> RequestHandle:
        """Validate and submit one request; returns at once. Bad input raises ValueError here.
        ``request_id``: a label the request's id starts with (``handle.request_id``, what ``abort``
        takes); the runtime adds a fresh suffix, so an id is never used twice and a late value of an
        ended request can never reach a new one. ``trace`` False: no walk trace is kept of it (a
        request of the server's own, such as the realtime route's VAD and prefill requests, which
        would take the place of the traces users ask for)."""
        if self._thread is None:
            raise RuntimeError("runtime is not started: use `with Runtime(...) as rt:` or rt.start()")
        reason = self.unhealthy_reason
        if reason:
            raise RuntimeError(f"runtime is unhealthy: {reason}")
        release_thread_pool()  # torch work the caller ran since start() left a pool (openmp.py)
        norm = {k: (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in inputs.items()}
        if isinstance(params, ModelRequest):  # parsed already (by the family's API adapter): taken as it is
            if not isinstance(params, self.model.request_type or ()):
                raise ValueError(f"{self.model.name}: a {type(params).__name__} is not this model's request")
            request = params
            self._check_fits(norm, request)
        else:  # parsed and validated here, once (ModelDef.parse_request)
            looked = ReadDict(dict(params or {}))
            request = self.model.parse_request(norm, looked)
            if request is looked:  # a family that keeps the mapping
                self._check_fits(norm, looked)
                request = dict(looked)
            else:
                self._check_fits(norm, request)
            if self.model.checks_params and (unread := looked.unread()):
                raise ValueError(f"{self.model.name}: params {unread} are not read by this model (it reads "
                                 f"{sorted(looked.read)})")
        fresh = uuid.uuid4().hex[:16]
        handle = RequestHandle(f"{request_id}-{fresh}" if request_id else fresh)
        self._command(lambda: self._conductor.submit(handle.request_id, norm, request, handle, trace))
        return handle

    def _check_fits(self, inputs: dict[str, list], params: Any) -> None:
        """Reject a request whose worst-case KV need (``ModelDef.max_kv_tokens``) exceeds a whole
        cache: it could never run, however long it waited."""
        limits = self.placement.limits
        size = limits.kv_block_size
        for module, tokens in self.model.max_kv_tokens(inputs, params).items():
            blocks = self._pool_blocks.get(module, limits.kv_cache_blocks)
            need = -(-tokens // size)
            if need > blocks:
                raise ValueError(f"{self.model.name}: this request may hold up to {tokens} tokens in the KV cache "
                                 f"of {module!r} ({need} blocks of {size}), more than the whole cache: {blocks} "
                                 f"blocks ({blocks * size} tokens); shorten the prompt or max_tokens, or give "
                                 f"the cache more room (kv_cache_blocks or kv_cache_memory_gib)")

    def generate(self, inputs: list[Mapping[str, Any]] | Mapping[str, Any],
                 params: Mapping[str, Any] | list[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Submit every request, wait for all; outputs in input order."""
        batch = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        plist = params if isinstance(params, list) else [params] * len(batch)
        handles = [self.submit(i, p) for i, p in zip(batch, plist)]
        return [h.result() for h in handles]

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the runtime's thread while the block runs, so that every request submitted inside
        starts in the same step (benchmarks: B requests arriving at once)."""
        gate = threading.Event()
        self._command(gate.wait)
        try:
            yield
        finally:
            gate.set()

    def abort(self, request_id: str) -> None:
        self._command(lambda: self._conductor.abort(request_id))

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """Per rank: KV blocks used/free, queue depths, per-node batch-size histograms, and KV
        pressure (requests waiting for blocks, preemptions, swapped-out requests) per KV module.
        ``RuntimeError`` at once when a rank is lost (or restarting) before every rank replied;
        ``TimeoutError`` after ``timeout`` seconds otherwise."""
        future: Future = Future()
        self._command(lambda: self._conductor.stats.collect(future))
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError("stats did not arrive") from None

    def trace(self, request_id: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The walk traces (``trace.trace_json``) of request ``request_id``, or of every request
        submitted with that label (``submit``'s ``request_id``): its walks, each with its node runs on
        every rank. [] when no kept trace matches (unknown, or older than the last
        ``trace_requests``). Errors as ``stats``'s."""
        future: Future = Future()
        self._command(lambda: self._conductor.trace(request_id, future))
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError("the trace did not arrive") from None

    # -- in-process access (inline mode), for tests and tools --------------------------------------
    def local_engine(self, module: str) -> StatelessEngine:
        """The engine running ``module`` on the first rank that holds it (inline mode only)."""
        return self.local_worker(module).engines[module]

    def local_worker(self, module: str) -> Any:
        """The ``Worker`` of the first rank that holds ``module`` (inline mode only)."""
        for w in self._driver.workers:
            if module in w.engines:
                return w
        where = "no rank holds it" if self.mode == "inline" else "workers run in other processes"
        raise LookupError(f"module {module!r} is not in this process: {where}")

    @property
    def worker_processes(self) -> list:
        """The worker processes (``multiprocessing.Process``, one per rank); empty inline."""
        return list(self._driver.processes)

    def local_module(self, module: str) -> Any:
        """The ``NodeSubmodule`` of ``module`` (inline mode only)."""
        return self.local_engine(module).module

    def _command(self, fn) -> None:
        self._loop.command(fn)
