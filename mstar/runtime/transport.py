"""Transports carry typed messages between the conductor (address -1) and the workers (rank).

``InlineTransport``: objects of one process; a message is handed over as is (no copy).
``ZmqTransport``: processes of one host over ZeroMQ IPC sockets; every message is encoded by
``mstar.runtime.serialization`` (msgpack header + raw tensor frames, never pickle) and tensors are
decoded without a copy from the received frames. Each endpoint binds one PULL socket and lazily
connects one PUSH socket per peer; ZeroMQ keeps per-peer FIFO order, which the protocol relies on
(e.g. a walk's NodeResults arrive in the order they were sent). A transport across hosts (TCP, RDMA)
implements the same three methods.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Any

from mstar.runtime.serialization import decode, encode


class InlineTransport:
    def __init__(self) -> None:
        self.boxes: dict[int, deque] = defaultdict(deque)
        self.wake = threading.Event()

    def send(self, dest: int, msg: Any) -> None:
        self.boxes[dest].append(msg)
        self.wake.set()


def ipc_address(run_dir: str, addr: int) -> str:
    return f"ipc://{run_dir}/{'conductor' if addr < 0 else f'rank{addr}'}.sock"


class ZmqTransport:
    """One endpoint: ``send`` to any address, ``recv`` what was sent to ``own``."""

    def __init__(self, run_dir: str, own: int) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.run_dir = run_dir
        self.own = own
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(ipc_address(run_dir, own))
        self.pushes: dict[int, Any] = {}
        self._lock = threading.Lock()  # send() may be called from a user thread and the driver

    def send(self, dest: int, msg: Any) -> None:
        frames = encode(msg)
        with self._lock:
            sock = self.pushes.get(dest)
            if sock is None:
                sock = self.ctx.socket(self._zmq.PUSH)
                sock.setsockopt(self._zmq.LINGER, 0)
                sock.setsockopt(self._zmq.SNDHWM, 0)  # never block the sender (a dead peer is detected elsewhere)
                sock.connect(ipc_address(self.run_dir, dest))
                self.pushes[dest] = sock
            sock.send_multipart(frames, copy=False)

    def recv(self, timeout_ms: int) -> list[Any]:
        """Every message waiting now; waits up to ``timeout_ms`` for the first one."""
        out = []
        if self.pull.poll(timeout_ms):
            while True:
                try:
                    frames = self.pull.recv_multipart(flags=self._zmq.NOBLOCK, copy=False)
                except self._zmq.Again:
                    break
                out.append(decode(frames))
        return out

    def close(self) -> None:
        with self._lock:
            for s in self.pushes.values():
                s.close(0)
            self.pushes.clear()
        self.pull.close(0)
