"""``MeshTransport``: the ZeroMQ transport across nodes, peers found through an ``AddressBook``.

The endpoint binds its PULL socket twice: on an IPC address (an abstract socket on Linux) and on a random TCP
port of its node's address (never 0.0.0.0). Sending to a peer of the same node id goes over IPC with
tensor frames of ``SHM_THRESHOLD`` bytes or more through /dev/shm, exactly as ``ZmqTransport``; to a
peer on another node over TCP, every tensor frame inline. Messages and their encoding are the same
either way (``mstar.runtime.wire.serialization``, never pickle).

A rank learns its peers from the ``AddressBook`` the conductor sends (``recv`` takes it in and
returns only the other messages); a message for a peer not in the book yet waits and goes, in
order, when the book arrives. A book that moves a peer (a restarted rank on a new port) replaces
the socket to it.

TCP connections carry ZeroMQ heartbeats and TCP keepalive and 8 MiB kernel buffers, and a monitor per outgoing TCP socket
records a dropped connection: ``lost_peers()`` names the peers whose link went down, which the
drivers treat as a dead rank (nothing is reconnected and resent).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from typing import Any

from mstar.runtime.wire.address_book import AddressBook, Endpoint, PeerHello
from mstar.runtime.wire.serialization import encode
from mstar.runtime.wire.shm_pool import ShmAttach, ShmPool
from mstar.runtime.wire.transport import SHM_THRESHOLD, ZmqTransport

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
TCP_BUFFER_BYTES = 8 << 20  # kernel socket buffers of TCP links: fewer round trips per large frame


def mesh_ipc_address(run_dir: str, run_id: str, addr: int) -> str:
    """On Linux an abstract socket (no file to leave behind, gone with its process), else a path."""
    name = f"{run_id}-{'conductor' if addr < 0 else f'rank{addr}'}"
    return f"ipc://@{name}" if sys.platform == "linux" else f"ipc://{run_dir}/{name}.sock"


def node_host() -> str:
    """The address this node's TCP endpoints bind: ``MSTAR_HOST_IP`` or loopback."""
    return os.environ.get("MSTAR_HOST_IP", "127.0.0.1")


class MeshTransport(ZmqTransport):
    """One endpoint of a run that may span nodes; ``endpoint`` says where it listens."""

    def __init__(self, run_dir: str, own: int, node_id: str, host: str, run_id: str,
                 force_tcp: bool = False) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.run_dir, self.own, self.node_id, self.force_tcp = run_dir, own, node_id, force_tcp
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.pull.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.pull.setsockopt(zmq.RCVBUF, TCP_BUFFER_BYTES)
        ipc = mesh_ipc_address(run_dir, run_id, own)
        self.pull.bind(ipc)
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = Endpoint(node_id, ipc, f"tcp://{host}:{port}")
        self.pushes: dict[int, Any] = {}
        self.shm_prefix = run_id  # one prefix per run: the driver sweeps every rank's leftovers of its node
        self.shm_threshold = SHM_THRESHOLD
        self._pool, self._attach = ShmPool(), ShmAttach()
        self._shm_count = 0
        self._lock = threading.Lock()
        self.book = AddressBook()
        self._routes: dict[int, str] = {}  # dest -> the address its push socket is connected to
        self._monitors: dict[int, Any] = {}  # dest -> monitor socket of its TCP push socket
        self._pending: deque[tuple[int, Any]] = deque()  # messages waiting for the book
        self.lost: set[int] = set()
        self.hellos: dict[int, Endpoint] = {}  # at the conductor: the endpoints ranks announced

    # -- the book ------------------------------------------------------------------------------------
    def install(self, book: AddressBook) -> None:
        """Take a (new) address book: re-route peers that moved, send what waited for it."""
        with self._lock:
            if book.version < self.book.version:
                return
            merged = dict(self.book.entries)
            merged.update(book.entries)
            self.book = AddressBook(merged, book.version)
            for dest in list(self.pushes):
                if dest in merged and self.book.route(self.node_id, dest, self.force_tcp)[0] != self._routes[dest]:
                    self._drop_push(dest)
                    self.lost.discard(dest)
            pending, self._pending = self._pending, deque()
        for dest, msg in pending:
            self.send(dest, msg)

    @property
    def links(self) -> dict[int, str]:
        """Peer -> the address its outgoing socket is connected to (ipc:// or tcp://)."""
        with self._lock:
            return dict(self._routes)

    def hello(self) -> PeerHello:
        return PeerHello(self.own, self.endpoint)

    # -- sending and receiving -----------------------------------------------------------------------
    def send(self, dest: int, msg: Any) -> None:
        with self._lock:
            if dest not in self.book.entries:
                self._pending.append((dest, msg))
                return
            address, local = self.book.route(self.node_id, dest, self.force_tcp)
        frames = encode(msg)
        frames = self._to_shm(frames, dest) if local else [b"\x90", *frames]  # no shm frames across nodes
        with self._lock:
            sock = self.pushes.get(dest)
            if sock is None:
                sock = self._connect(dest, address, local)
            sock.send_multipart(frames, copy=False)

    def recv(self, timeout_ms: int) -> list[Any]:
        """Every message waiting now (address books and hellos are taken in, not returned)."""
        out = []
        for msg in super().recv(timeout_ms):
            if isinstance(msg, AddressBook):
                self.install(msg)
            elif isinstance(msg, PeerHello):  # to the conductor: a rank (re)bound its endpoint
                self.hellos[msg.addr] = msg.endpoint
                self.install(AddressBook({msg.addr: msg.endpoint}, self.book.version))
            else:
                out.append(msg)
        return out

    def _connect(self, dest: int, address: str, local: bool) -> Any:
        zmq = self._zmq
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if not local:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.SNDBUF, TCP_BUFFER_BYTES)
            self._monitors[dest] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self.pushes[dest] = sock
        self._routes[dest] = address
        return sock

    def _drop_push(self, dest: int) -> None:
        mon = self._monitors.pop(dest, None)
        sock = self.pushes.pop(dest)
        if mon is not None:
            sock.disable_monitor()
            mon.close(0)
        sock.close(0)
        self._routes.pop(dest, None)

    # -- peers that went away ------------------------------------------------------------------------
    def lost_peers(self) -> set[int]:
        """Peers whose TCP connection from this endpoint dropped (each stays lost until a new book
        moves it)."""
        from zmq.utils.monitor import recv_monitor_message

        with self._lock:
            for dest, mon in self._monitors.items():
                while True:
                    try:
                        event = recv_monitor_message(mon, flags=self._zmq.NOBLOCK)
                    except self._zmq.Again:
                        break
                    if event["event"] == self._zmq.EVENT_DISCONNECTED:
                        self.lost.add(dest)
            return set(self.lost)

    def sweep_own_shm(self) -> None:
        """Remove the shared-memory files this endpoint wrote that nobody consumed."""
        self.sweep_shm(sender=self.own)

    def close(self, linger_ms: int = 0) -> None:
        with self._lock:
            for dest in list(self._monitors):
                mon = self._monitors.pop(dest)
                self.pushes[dest].disable_monitor()
                mon.close(0)
        super().close(linger_ms)
