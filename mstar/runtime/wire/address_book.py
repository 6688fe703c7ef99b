"""Where every endpoint of a run listens, and which ones share a machine.

Each endpoint (the conductor, every rank) binds one ZeroMQ PULL socket on an IPC path and on a TCP
port of its node's address, and announces both with its node id (``PeerHello``). The conductor
collects them into an ``AddressBook`` and sends it to every rank; a sender reaches a peer of its own
node over IPC (and large tensors through /dev/shm) and any other peer over TCP (tensors inline in
the frames). Nodes are told apart by id (a Ray node id, or a name the driver picks), never by IP
address: two simulated nodes on one host share 127.0.0.1 but not an id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.runtime.wire.serialization import register_message


@register_message
@dataclass(frozen=True)
class Endpoint:
    """One endpoint's two bound addresses and the node it runs on."""

    node_id: str
    ipc: str  # ipc://... (only reachable from the same node)
    tcp: str  # tcp://<node address>:<port>


@register_message
@dataclass
class PeerHello:
    """An endpoint -> the conductor, once its sockets are bound: where it listens."""

    addr: int  # rank, or CONDUCTOR
    endpoint: Endpoint


@register_message
@dataclass
class AddressBook:
    """Conductor -> every rank: the endpoints of the whole run (sent again when a rank moves)."""

    entries: dict[int, Endpoint] = field(default_factory=dict)
    version: int = 0

    def route(self, own_node: str, dest: int, force_tcp: bool = False) -> tuple[str, bool]:
        """The address to connect to for ``dest`` and whether it is on this node (IPC, shm)."""
        ep = self.entries[dest]
        local = ep.node_id == own_node and not force_tcp
        return (ep.ipc if local else ep.tcp), local

    def nodes(self) -> dict[str, list[int]]:
        """Node id -> the addresses on it (for logs and tests)."""
        out: dict[str, list[int]] = {}
        for addr, ep in sorted(self.entries.items()):
            out.setdefault(ep.node_id, []).append(addr)
        return out
