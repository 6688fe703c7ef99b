"""``RayDriver``: one Ray actor per rank (``Runtime(..., workers="ray")``); Ray is imported here only.

Ray places and starts the ranks and reports their deaths; messages never go through Ray. Start:

1. connect to the cluster (``ray.init(address)`` unless this process already is connected);
2. one placement group: a bundle per ``nodes:`` entry of the placement (``STRICT_SPREAD``: distinct
   Ray nodes; a bundle also asks for the custom resource ``mstar_node_<name>`` when the cluster
   has it, which pins a logical host to the Ray nodes started with it), or without the section one
   bundle for every rank on the driver's host (``node:<address>``); waited for at most ``start_timeout`` seconds,
   then an error that names what the cluster lacks;
3. a ``RankActor`` per rank in its node's bundle, whose ``run()`` binds the rank's ``MeshTransport``
   (IPC, and TCP on the node's address: ``MSTAR_HOST_IP`` or Ray's node address), announces it,
   builds the worker and serves until ``Shutdown``;
4. once every rank reported ready, the conductor sends the ``AddressBook``: peers of the same Ray
   node id use IPC and /dev/shm, the others TCP.

A rank is dead when its ``run()`` call ends (the actor died or was killed) or its TCP link from
the conductor drops; Ray mode does not restart ranks, so the runtime gives up (``Runtime.fatal``)
and in-flight requests fail as ``WORKER_LOST``. ``stop`` sends ``Shutdown``, waits a little, kills
every actor, removes the placement group and disconnects from Ray if it connected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

from mstar.runtime.conductor import Conductor
from mstar.runtime.drivers.mesh import broadcast_book
from mstar.runtime.drivers.mesh_worker import MeshJoin, serve_rank
from mstar.runtime.handles import held_wakeups
from mstar.runtime.routing import Routing
from mstar.runtime.wire.address_book import AddressBook
from mstar.runtime.wire.mesh_transport import MeshTransport
from mstar.runtime.wire.messages import CONDUCTOR, Shutdown, WorkerStatus

log = logging.getLogger("mstar.runtime")

NODE_RESOURCE = "mstar_node_{}"  # custom resource that pins a logical host to Ray nodes
PIN_AMOUNT = 0.001
SHUTDOWN_GRACE_S = 5.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("workers='ray' needs Ray: pip install 'mstar[ray]'") from e
    return ray


def node_address() -> str:
    """The address this Ray node's TCP endpoints bind: ``MSTAR_HOST_IP``, else Ray's node address."""
    ray = import_ray()
    return os.environ.get("MSTAR_HOST_IP") or ray.util.get_node_ip_address()


class RankActor:
    """The body of one rank's actor (made a Ray actor class with ``ray.remote`` by the driver)."""

    def __init__(self, rank: int, model: Any, placement: Any, device: str, join: MeshJoin) -> None:
        self.rank, self.model, self.placement, self.device, self.join = rank, model, placement, device, join

    def run(self) -> None:
        ray = import_ray()
        join = dataclasses.replace(self.join, node_id=ray.get_runtime_context().get_node_id(),
                                   host=node_address())
        serve_rank(self.rank, self.model, self.placement, self.device, join)


@dataclass(frozen=True)
class Bundle:
    """One placement-group bundle: a logical host, its ranks and the resources it asks for."""

    name: str
    ranks: tuple[int, ...]
    resources: dict[str, float]


def plan_bundles(routing: Routing, device: str, cluster_resources: dict[str, float],
                 host: str | None = None) -> list[Bundle]:
    """A bundle per ``nodes:`` entry (pinned where the cluster has its ``mstar_node_<name>``), or one
    for every rank on this host (Ray's ``node:<host address>`` resource)."""
    unit = "CPU" if device == "cpu" else "GPU"
    nodes = routing.placement.cluster_nodes
    if not nodes:
        resources = {unit: float(routing.num_ranks)}
        if unit == "GPU":
            resources["CPU"] = float(routing.num_ranks)
        if host is not None and f"node:{host}" in cluster_resources:
            resources[f"node:{host}"] = PIN_AMOUNT
        return [Bundle("<this host>", tuple(range(routing.num_ranks)), resources)]
    out = []
    for n in nodes:
        resources = {unit: float(len(n.ranks))}
        if unit == "GPU":
            resources["CPU"] = float(len(n.ranks))
        pin = NODE_RESOURCE.format(n.name)
        if pin in cluster_resources:
            resources[pin] = PIN_AMOUNT
        out.append(Bundle(n.name, n.ranks, resources))
    return out


def missing_resources(bundles: list[Bundle], ray_nodes: list[dict]) -> str:
    """What no live Ray node can give, bundle by bundle (for the placement-group timeout)."""
    totals = [n.get("Resources", {}) for n in ray_nodes if n.get("Alive")]
    parts = []
    for b in bundles:
        for key, need in b.resources.items():
            best = max((t.get(key, 0.0) for t in totals), default=0.0)
            if best < need:
                parts.append(f"node {b.name!r} needs {key}={need:g}, the largest Ray node has {best:g}")
    if not parts:
        parts.append(f"{len(bundles)} bundle(s) on distinct Ray nodes: the cluster has {len(totals)} "
                     f"live node(s), or their resources are held by other placement groups")
    return "; ".join(parts)


class RayDriver:
    """Ranks as Ray actors; the runtime's thread runs the conductor on a ``MeshTransport``."""

    CHECK_EVERY_S = 0.25
    processes: list = []  # no local worker processes

    def __init__(self, model: Any, routing: Routing, device: str, start_timeout: float,
                 address: str | None = None) -> None:
        self.model, self.routing, self.device = model, routing, device
        self.start_timeout, self.address = start_timeout, address
        self.workers: list = []
        self.transport: MeshTransport | None = None
        self.actors: dict[int, Any] = {}
        self.rank_nodes: dict[int, str] = {}  # rank -> Ray node id it runs on (after start)
        self.bundles: list[Bundle] = []
        self.lost: str | None = None
        self.gave_up: str | None = None
        self._runs: dict[Any, int] = {}  # ObjectRef of each actor's run() -> rank
        self._pg = None
        self._owns_ray = False
        self._last_check = 0.0

    # -- start ---------------------------------------------------------------------------------------
    def start(self) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=True)
            self._owns_ray = True
        try:
            self._place(ray)
            self._launch(ray)
            self._wait_ready(ray)
        except BaseException:
            self.stop()
            raise
        self.rank_nodes = {r: ep.node_id for r, ep in self.transport.hellos.items()}
        broadcast_book(self.transport, range(self.routing.num_ranks))
        log.info("ray: %d rank(s) on %d node(s): %s", len(self.actors), len(set(self.rank_nodes.values())),
                 AddressBook(self.transport.hellos).nodes())

    def _place(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group

        self.bundles = plan_bundles(self.routing, self.device, ray.cluster_resources(), node_address())
        strategy = "STRICT_SPREAD" if len(self.bundles) > 1 else "STRICT_PACK"
        self._pg = placement_group([b.resources for b in self.bundles], strategy=strategy,
                                   name=f"mstar-{uuid.uuid4().hex[:8]}")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.start_timeout)
        if not ready:
            raise RuntimeError(f"the Ray placement group ({strategy}, bundles "
                               f"{[b.resources for b in self.bundles]}) was not placed in {self.start_timeout:g} s: "
                               f"{missing_resources(self.bundles, ray.nodes())}; available now: "
                               f"{ray.available_resources()}")

    def _launch(self, ray: Any) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        run_id = f"mstar-{uuid.uuid4().hex[:12]}"
        node_id = ray.get_runtime_context().get_node_id()
        self.transport = MeshTransport(tempfile.gettempdir(), CONDUCTOR, node_id, node_address(), run_id)
        self.transport.install(AddressBook({CONDUCTOR: self.transport.endpoint}))
        join = MeshJoin(run_id, self.transport.endpoint, node_id="", host="")  # the actor fills in its node
        actor_cls = ray.remote(RankActor)
        gpu = self.device != "cpu"
        for index, bundle in enumerate(self.bundles):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                        placement_group_bundle_index=index)
            for rank in bundle.ranks:
                actor = actor_cls.options(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                                          scheduling_strategy=strategy, name=f"{run_id}-rank{rank}").remote(
                    rank, self.model, self.routing.placement, self.device, join)
                self.actors[rank] = actor
                self._runs[actor.run.remote()] = rank

    def _wait_ready(self, ray: Any) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < len(self.actors):
            for msg in self.transport.recv(100):
                if isinstance(msg, WorkerStatus):
                    if not msg.ok:
                        raise RuntimeError(f"worker rank {msg.rank} failed to start:\n{msg.error}")
                    log.info("worker rank %d ready: weights in memory %.1f MiB", msg.rank, msg.weight_bytes / 2**20)
                    ready.add(msg.rank)
            ended, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=0)
            if ended:
                self.transport.recv(500)  # its last word may still be on the way
                raise RuntimeError(f"worker rank {self._runs[ended[0]]} ended while starting: "
                                   f"{self._why_ended(ray, ended[0])}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker rank(s) {sorted(set(self.actors) - ready)} not ready in "
                                   f"{self.start_timeout:g} s")

    @staticmethod
    def _why_ended(ray: Any, ref: Any) -> str:
        try:
            ray.get(ref, timeout=0)
        except Exception as e:  # noqa: BLE001 - any failure of the actor is the reason
            first = (str(e).strip().splitlines() or [""])[0]
            return f"{type(e).__name__}: {first}"[:300]
        return "its run() returned"

    # -- serving -------------------------------------------------------------------------------------
    def pump(self, conductor: Conductor, busy: bool) -> bool:
        did = False
        with held_wakeups():  # one wake-up per consumer loop for what this receive brought (handles.py)
            for msg in self.transport.recv(0 if busy else 5):
                if not isinstance(msg, WorkerStatus):
                    conductor.handle(msg)
                did = True
        now = time.monotonic()
        if self.gave_up is None and now - self._last_check >= self.CHECK_EVERY_S:
            self._last_check = now
            self._watch()
        return did

    def _watch(self) -> None:
        ray = import_ray()
        ended, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=0)
        if ended:
            rank = self._runs[ended[0]]
            self._give_up(f"worker rank {rank} died ({self._why_ended(ray, ended[0])})")
            return
        lost = sorted(r for r in self.transport.lost_peers() if r in self.actors)
        if lost:
            self._give_up(f"worker rank {lost[0]} lost: its TCP connection dropped")

    def _give_up(self, why: str) -> None:
        log.error("%s; ranks are not restarted with workers='ray': the runtime cannot serve any more", why)
        self.gave_up = self.lost = why

    def idle(self) -> None:
        pass

    def wake(self) -> None:
        if self.transport is not None:
            self.transport.interrupt()  # the loop's receive returns: it runs the command at once

    # -- stop ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask every rank to shut down, kill the actors, remove the placement group, sweep shm."""
        ray = import_ray()
        if self.transport is not None:
            for rank in self.actors:
                self.transport.send(rank, Shutdown("runtime shutdown"))
        if self._runs:
            ray.wait(list(self._runs), num_returns=len(self._runs), timeout=SHUTDOWN_GRACE_S)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self._runs.clear()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self.transport is not None:
            self.transport.sweep_shm()
            self.transport.close()
            self.transport = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
