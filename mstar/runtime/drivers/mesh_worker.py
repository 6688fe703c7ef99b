"""A rank's life on a ``MeshTransport``: bind, announce, build, serve (worker processes and Ray actors).

The rank binds its endpoint, tells the conductor where it listens (``PeerHello``), builds its
``Worker`` and reports ``WorkerStatus`` (with the traceback when it could not), then loops like a
process worker: receive -> handle -> one batched forward, until told to shut down or ``orphaned``
says the serving side is gone. Peers are reached once the conductor's ``AddressBook`` arrives.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mstar.runtime.wire.address_book import AddressBook, Endpoint
from mstar.runtime.wire.messages import CONDUCTOR


@dataclass(frozen=True)
class MeshJoin:
    """What a rank needs to join a run: the run's id, where the conductor listens, the rank's node."""

    run_id: str
    conductor: Endpoint
    node_id: str
    host: str  # the address the rank's TCP endpoint binds
    force_tcp: bool = False  # TCP to every peer, even on the same node (tests, benchmarks)


def serve_rank(rank: int, model: Any, placement: Any, device: str, join: MeshJoin,
               orphaned: Callable[[], bool] = lambda: False) -> None:
    """Run one rank until ``Shutdown`` (or ``orphaned()`` while idle); returns when it is over."""
    from mstar.runtime.drivers.process import run_rank, set_rank_threads

    set_rank_threads(placement, rank)
    from mstar.runtime.routing import Routing
    from mstar.runtime.wire.mesh_transport import MeshTransport
    from mstar.runtime.worker import Worker

    run_dir = tempfile.gettempdir()  # for IPC paths where abstract sockets do not exist
    transport = MeshTransport(run_dir, rank, join.node_id, join.host, join.run_id, join.force_tcp)
    transport.install(AddressBook({CONDUCTOR: join.conductor}))
    transport.send(CONDUCTOR, transport.hello())
    run_rank(rank, lambda: Worker(rank, model, Routing(model.graph, placement), transport, device), transport,
             orphaned, cleanup=transport.sweep_own_shm)
