"""Transports carry typed messages between the conductor (address -1) and the workers (rank).

``InlineTransport``: objects of one process; a message is handed over as is (no copy).
``ZmqTransport``: processes of one host over ZeroMQ IPC sockets; every message is encoded by
``mstar.runtime.wire.serialization`` (msgpack header + raw tensor frames, never pickle) and tensors are
decoded without a copy from the received frames. Tensor frames of 1 MiB or more go through POSIX
shared memory instead of the socket. Each endpoint binds one PULL socket and lazily
connects one PUSH socket per peer; ZeroMQ keeps per-peer FIFO order, which the protocol relies on
(e.g. a walk's NodeResults arrive in the order they were sent). A transport across hosts (TCP, RDMA)
implements the same three methods.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import defaultdict, deque
from typing import Any

import msgpack

from mstar.runtime.wire.serialization import decode, encode
from mstar.runtime.wire.shm_pool import ShmAttach, ShmPool

# tensor frames this large travel through shared memory (one copy instead of two through the socket)
SHM_THRESHOLD = int(os.environ.get("MSTAR_SHM_THRESHOLD", 1 << 20))
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None

log = logging.getLogger(__name__)


class LostFrame(Exception):
    """A message's shared-memory frame is gone: it was addressed to a rank that died, and the files
    queued for it were swept (the message is dropped; every request it served has failed)."""


class InlineTransport:
    def __init__(self) -> None:
        self.boxes: dict[int, deque] = defaultdict(deque)
        self.wake = threading.Event()

    def send(self, dest: int, msg: Any) -> None:
        self.boxes[dest].append(msg)
        if not self.wake.is_set():  # set() takes the event's lock: once per idle period is enough
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
        self.shm_prefix = "mstar-" + os.path.basename(run_dir.rstrip("/"))
        self.shm_threshold = SHM_THRESHOLD
        self._pool, self._attach = ShmPool(), ShmAttach()  # reused segments (``shm_pool.py``)
        self._shm_count = 0
        self._lock = threading.Lock()  # send() may be called from a user thread and the driver

    def send(self, dest: int, msg: Any) -> None:
        frames = self._to_shm(encode(msg), dest)
        with self._lock:
            sock = self.pushes.get(dest)
            if sock is None:
                sock = self.ctx.socket(self._zmq.PUSH)
                sock.setsockopt(self._zmq.LINGER, 0)
                sock.setsockopt(self._zmq.SNDHWM, 0)  # never block the sender (a dead peer is detected elsewhere)
                sock.connect(ipc_address(self.run_dir, dest))
                self.pushes[dest] = sock
            sock.send_multipart(frames, copy=False)

    # the endpoint's in-process wake-up pair (``interrupt``), made by the first ``recv``
    _wake_pull: Any = None
    _wake_push: Any = None
    _poller: Any = None

    def _wake_pair(self) -> Any:
        with self._lock:
            if self._wake_pull is None:
                zmq = self._zmq
                address = f"inproc://mstar-wake-{os.getpid()}-{id(self)}"
                pull, push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
                pull.bind(address)
                push.setsockopt(zmq.LINGER, 0)
                push.setsockopt(zmq.SNDHWM, 0)
                push.connect(address)
                self._poller = zmq.Poller()
                self._poller.register(self.pull, zmq.POLLIN)
                self._poller.register(pull, zmq.POLLIN)
                self._wake_pull, self._wake_push = pull, push
        return self._wake_pull

    def interrupt(self) -> None:
        """Make a ``recv`` waiting on this endpoint return now; any thread may call it (a caller's
        command for the runtime's thread must not wait out the idle poll)."""
        self._wake_pair()
        with self._lock:
            self._wake_push.send(b"", flags=self._zmq.NOBLOCK)

    def recv(self, timeout_ms: int) -> list[Any]:
        """Every message waiting now; waits up to ``timeout_ms`` for the first one, or until
        ``interrupt``."""
        out = []
        wake = self._wake_pair()
        ready = dict(self._poller.poll(timeout_ms))
        if wake in ready:
            while True:
                try:
                    wake.recv(flags=self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
        if self.pull in ready:
            while True:
                try:
                    frames = self.pull.recv_multipart(flags=self._zmq.NOBLOCK, copy=False)
                except self._zmq.Again:
                    break
                try:
                    out.append(decode(self._from_shm(frames)))
                except LostFrame as e:
                    log.warning("dropped a message for a dead rank's process: %s", e)
        return out

    # Large frames: the sender copies the bytes into a free segment of its pool (``shm_pool.py``), or,
    # when none is free, writes them into a fresh file in /dev/shm (POSIX shared memory)
    # and sends its name; the receiver maps it, unlinks the name at once (the mapping stays valid
    # while a decoded tensor uses it) and decodes the tensor straight from the mapping. Frame 0 of
    # the wire message lists the indexes of such frames; names start with the run's prefix and name
    # the destination, so the files a dead receiver left behind can be swept (when it dies, and at
    # shutdown).
    def _to_shm(self, frames: list, dest: int) -> list:
        big = [] if not SHM_DIR else [i for i, f in enumerate(frames)
                                      if i > 0 and memoryview(f).nbytes >= self.shm_threshold]
        if not big:
            return [b"\x90", *frames]  # msgpack empty list: no shared-memory frames
        out = list(frames)
        for i in big:
            ref = self._pool.put(memoryview(frames[i]).cast("B"))
            if ref is not None:
                out[i] = ref
                continue
            self._shm_count += 1
            # the pid keeps the names of a restarted rank apart from those its dead process left
            name = f"{self._dest_prefix(dest)}{self.own + 1}-{os.getpid()}-{self._shm_count}"
            fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                view = memoryview(frames[i]).cast("B")
                written = 0
                while written < view.nbytes:
                    written += os.write(fd, view[written:])
            finally:
                os.close(fd)
            out[i] = f"{name}:{view.nbytes}".encode()
        return [msgpack.packb(big), *out]

    def _from_shm(self, frames: list) -> list:
        raw0 = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
        big = msgpack.unpackb(bytes(raw0))
        frames = list(frames[1:])
        for i in big:
            raw = bytes(frames[i].buffer if hasattr(frames[i], "buffer") else frames[i])
            if self._attach.is_pooled(raw):
                frames[i] = self._attach.open(raw)
                continue
            name, _, size = raw.decode().rpartition(":")
            path = os.path.join(SHM_DIR, name)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise LostFrame(f"shared-memory frame {name} was swept") from None
            try:
                frames[i] = memoryview(mmap.mmap(fd, int(size)))
            finally:
                os.close(fd)
                os.unlink(path)
        return frames

    def _dest_prefix(self, dest: int) -> str:
        return f"{self.shm_prefix}-to{dest + 1}-"

    def sweep_shm(self, dest: int | None = None, sender: int | None = None) -> None:
        """Remove shared-memory files of this run that no receiver consumed: those addressed to
        ``dest`` (a rank that died: what was in its process's buffers is lost), those ``sender``
        wrote, or all of them. Names: ``<run>-to<dest + 1>-<sender + 1>-<pid>-<n>``."""
        if not SHM_DIR:
            return
        prefix = self.shm_prefix + "-" if dest is None else self._dest_prefix(dest)
        for name in os.listdir(SHM_DIR):
            if not name.startswith(prefix):
                continue
            if sender is not None and name[len(self.shm_prefix) + 1:].split("-")[1:2] != [str(sender + 1)]:
                continue
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets; ``linger_ms`` > 0 first lets queued outgoing messages go (a last word)."""
        with self._lock:
            for s in self.pushes.values():
                s.close(linger_ms)
            self.pushes.clear()
        self.pull.close(0)
        if self._wake_pull is not None:
            self._wake_pull.close(0)
            self._wake_push.close(0)
        self._pool.close()
        self._attach.close()
