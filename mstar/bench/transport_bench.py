"""``mstar bench transport``: how fast one tensor message moves between two endpoints, per path.

Paths: ``inline`` (``InlineTransport``, one process: a hand-off), ``ipc`` (``ZmqTransport``, tensor
frames inline in the IPC socket), ``shm`` (the same, frames of ``SHM_THRESHOLD`` bytes or more
through /dev/shm), ``tcp`` (``MeshTransport`` on 127.0.0.1 between two node ids: frames inline in the
TCP stream). Baselines: ``memcpy`` (one single-threaded copy into a warm buffer, numpy), ``socket``
(the payload through a plain loopback TCP socket into a preallocated, warm buffer) and ``socket-new``
(the same into a newly allocated buffer per message: what any receiver that keeps the tensor pays,
ZeroMQ's receive included) and ``zmq`` (plain ZeroMQ PUSH/PULL over loopback TCP, default options, no
mstar code: the floor of the ``tcp`` path).

Every path but ``inline`` and ``memcpy`` runs between this process and a spawned peer process: the
sender sends the tensor, the peer decodes the message and answers with a small acknowledgement; one
round is the time per message, bandwidth is size / the median round. The first message of each size
is checked end to end (the peer returns the payload's checksum).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.bench import harness
from mstar.runtime.wire.serialization import register_message

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
PATHS = ("inline", "ipc", "shm", "tcp")
PEER = 0  # the peer's address; this process is the conductor's address
BUDGET_S = 0.5  # time spent per size and path after warm-up (at least MIN_ROUNDS rounds)
MIN_ROUNDS = 3


@register_message
@dataclass
class Blob:
    seq: int
    data: Any  # a uint8 tensor
    check: bool = False


@register_message
@dataclass
class BlobAck:
    seq: int
    crc: int = 0


def _payload(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().tobytes())


# -- the peer process ---------------------------------------------------------------------------------
def _peer_transport(path: str, setup: dict) -> Any:
    from mstar.runtime.wire.address_book import AddressBook
    from mstar.runtime.wire.mesh_transport import MeshTransport
    from mstar.runtime.wire.messages import CONDUCTOR
    from mstar.runtime.wire.transport import ZmqTransport

    if path == "tcp":
        t = MeshTransport(setup["run_dir"], PEER, "peer", "127.0.0.1", setup["run_id"])
        t.install(AddressBook({CONDUCTOR: setup["endpoint"]}))
        t.send(CONDUCTOR, t.hello())
        return t
    t = ZmqTransport(setup["run_dir"], PEER)
    t.shm_threshold = setup["shm_threshold"]
    return t


def _peer_main(path: str, setup: dict) -> None:
    from mstar.runtime.wire.messages import CONDUCTOR

    t = _peer_transport(path, setup)
    try:
        while True:
            for msg in t.recv(1000):
                if msg is None or (isinstance(msg, Blob) and msg.seq < 0):
                    return
                t.send(CONDUCTOR, BlobAck(msg.seq, _crc(msg.data) if msg.check else 0))
    finally:
        t.close(linger_ms=1000)


def _socket_peer(port_queue: Any, fresh: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_queue.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            warm = np.zeros(0, dtype=np.uint8)
            while True:
                header = _recv_exact(conn, memoryview(bytearray(8)))
                n = int.from_bytes(header, "little")
                if n == 0:
                    return
                if n > warm.size:  # grown in the untimed first round of a size
                    warm = np.zeros(n, dtype=np.uint8)
                buf = np.empty(n, dtype=np.uint8) if fresh else warm[:n]  # fresh: new pages, as a receiver
                _recv_exact(conn, memoryview(buf))                         # that keeps the tensor gets
                conn.sendall(b"k")


def _zmq_peer(port_in: int, port_out: int) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"tcp://127.0.0.1:{port_in}")
    push.connect(f"tcp://127.0.0.1:{port_out}")
    try:
        while True:
            frame = pull.recv(copy=False)
            if len(frame) == 0:
                return
            del frame
            push.send(b"k")
    finally:
        pull.close(0)
        push.close(1000)


def _measure_zmq(sizes: list[int]) -> dict[int, list[float]]:
    """Plain ZeroMQ PUSH/PULL over loopback TCP (default options, zero-copy send and receive)."""
    import zmq

    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port_in, port_out = push.bind_to_random_port("tcp://127.0.0.1"), pull.bind_to_random_port("tcp://127.0.0.1")
    peer = mp.get_context("spawn").Process(target=_zmq_peer, args=(port_in, port_out), daemon=True)
    peer.start()
    out = {}
    try:
        for size in sizes:
            payload = memoryview(_payload(size).numpy())

            def one(payload=payload) -> None:
                push.send(payload, copy=False)
                pull.recv()

            t0 = time.perf_counter()
            one()
            out[size] = _rounds(one, time.perf_counter() - t0)
        push.send(b"")
        peer.join(30)
    finally:
        if peer.is_alive():
            peer.kill()
        push.close(0)
        pull.close(0)
    return out


def _recv_exact(conn: socket.socket, view: memoryview) -> memoryview:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
    return view


# -- measurements -------------------------------------------------------------------------------------
def _rounds(one_round, est_s: float) -> list[float]:
    """Seconds of each round, as many as fit ``BUDGET_S`` (at least ``MIN_ROUNDS``), through the
    harness; the callers' own first round (the checked one, or the estimate) is the warm-up."""
    n = max(MIN_ROUNDS, min(500, int(BUDGET_S / max(est_s, 1e-6))))
    return harness.rotate_timed({"path": one_round}, n, warm=False)["path"]


def _measure_memcpy(size: int) -> list[float]:
    src, dst = _payload(size).numpy(), np.empty(size, dtype=np.uint8)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return _rounds(lambda: np.copyto(dst, src), time.perf_counter() - t0)


def _measure_inline(size: int) -> list[float]:
    from mstar.runtime.wire.transport import InlineTransport

    t, data = InlineTransport(), _payload(size)

    def one() -> None:
        t.send(PEER, Blob(0, data))
        t.boxes[PEER].popleft()

    return _rounds(one, 1e-5)


def _measure_socket(sizes: list[int], fresh: bool = False) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    peer = ctx.Process(target=_socket_peer, args=(ports, fresh), daemon=True)
    peer.start()
    out = {}
    with socket.create_connection(("127.0.0.1", ports.get(timeout=60))) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ack = memoryview(bytearray(1))
        for size in sizes:
            payload = memoryview(_payload(size).numpy())

            def one(size=size, payload=payload) -> None:
                conn.sendall(size.to_bytes(8, "little"))
                conn.sendall(payload)
                _recv_exact(conn, ack)

            t0 = time.perf_counter()
            one()
            out[size] = _rounds(one, time.perf_counter() - t0)
        conn.sendall((0).to_bytes(8, "little"))
    peer.join(30)
    return out


def _measure_transport(path: str, sizes: list[int]) -> dict[int, list[float]]:
    from mstar.runtime.wire.address_book import AddressBook
    from mstar.runtime.wire.mesh_transport import MeshTransport
    from mstar.runtime.wire.messages import CONDUCTOR
    from mstar.runtime.wire.transport import SHM_THRESHOLD, ZmqTransport

    run_dir = tempfile.mkdtemp(prefix="mstar-bench-")
    setup: dict[str, Any] = {"run_dir": run_dir, "run_id": f"mstar-{uuid.uuid4().hex[:12]}",
                             "shm_threshold": SHM_THRESHOLD if path == "shm" else 1 << 62}
    if path == "tcp":
        t = MeshTransport(run_dir, CONDUCTOR, "bench", "127.0.0.1", setup["run_id"])
        t.install(AddressBook({CONDUCTOR: t.endpoint}))
        setup["endpoint"] = t.endpoint
    else:
        t = ZmqTransport(run_dir, CONDUCTOR)
        t.shm_threshold = setup["shm_threshold"]
    peer = mp.get_context("spawn").Process(target=_peer_main, args=(path, setup), daemon=True)
    peer.start()
    try:
        return {size: _measure_size(t, size) for size in sizes}
    finally:
        t.send(PEER, Blob(-1, torch.zeros(0, dtype=torch.uint8)))
        peer.join(30)
        if peer.is_alive():
            peer.kill()
        t.sweep_shm()
        t.close()


def _measure_size(t: Any, size: int) -> list[float]:
    data = _payload(size)
    t.send(PEER, Blob(1, data, check=True))
    (ack,) = _wait(t, 1)
    if ack.crc != _crc(data):
        raise RuntimeError(f"transport bench: the {size}-byte payload arrived changed")
    t0 = time.perf_counter()

    def one() -> None:
        t.send(PEER, Blob(2, data))
        _wait(t, 1)

    one()
    return _rounds(one, time.perf_counter() - t0)


def _wait(t: Any, n: int, timeout_s: float = 120.0) -> list[BlobAck]:
    got: list[BlobAck] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("transport bench: the peer did not answer")
        got += t.recv(1000)
    return got


@dataclass
class TransportRow:
    """One size: the median seconds per message of each path and baseline."""

    size: int
    seconds: dict[str, float]

    def gbps(self, path: str) -> float:
        return self.size / self.seconds[path] / 1e9


def run_transport_bench(sizes: list[int] | None = None, paths: tuple[str, ...] = PATHS) -> list[TransportRow]:
    import statistics

    sizes = list(sizes or SIZES)
    per: dict[str, dict[int, list[float]]] = {
        "memcpy": {s: _measure_memcpy(s) for s in sizes},
        "socket": _measure_socket(sizes),
        "socket-new": _measure_socket(sizes, fresh=True),
        "zmq": _measure_zmq(sizes),
    }
    for path in paths:
        per[path] = ({s: _measure_inline(s) for s in sizes} if path == "inline"
                     else _measure_transport(path, sizes))
    return [TransportRow(s, {k: statistics.median(v[s]) for k, v in per.items()}) for s in sizes]


def parse_sizes(text: str) -> list[int]:
    """``4K,1M,64M`` -> bytes (K = 1024, M = 1024 * 1024); every size at least 1 and at most 1 GiB."""
    out = []
    for part in (p.strip().upper() for p in text.split(",")):
        if not part:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(part[-1], 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or not 1 <= int(digits) * scale <= 1 << 30:
            raise ValueError(f"--sizes takes sizes like 4K, 1M or 65536 (at most 1 GiB), got {part!r}")
        out.append(int(digits) * scale)
    if not out:
        raise ValueError("--sizes is empty")
    return out


def _fmt_size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MB"
    return f"{n >> 10} KB" if n % (1 << 10) == 0 else f"{n} B"


def format_table(rows: list[TransportRow]) -> str:
    paths = [p for p in ("memcpy", "socket", "socket-new", "zmq", *PATHS) if p in rows[0].seconds]
    head = ["size", *[f"{p} GB/s" for p in paths if p != "inline"], "inline µs"]
    extra = [c for c, need in (("shm/memcpy", "shm"), ("tcp/socket", "tcp"), ("tcp/socket-new", "tcp"),
                               ("tcp/zmq", "tcp")) if need in paths]
    lines = ["| " + " | ".join(head + extra) + " |", "|" + "---|" * (len(head) + len(extra))]
    for r in rows:
        cells = [_fmt_size(r.size), *[f"{r.gbps(p):.2f}" for p in paths if p != "inline"]]
        cells.append(f"{r.seconds['inline'] * 1e6:.1f}" if "inline" in paths else "-")
        if "shm" in paths:
            cells.append(f"{r.seconds['memcpy'] / r.seconds['shm']:.0%}")
        if "tcp" in paths:
            cells.append(f"{r.seconds['socket'] / r.seconds['tcp']:.0%}")
            cells.append(f"{r.seconds['socket-new'] / r.seconds['tcp']:.0%}")
            cells.append(f"{r.seconds['zmq'] / r.seconds['tcp']:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
