"""Reused shared-memory segments for large tensor frames between the processes of one host.

A fresh /dev/shm file per frame costs the kernel a page allocation (and zeroing) per 4 KiB on the
sender and the freeing of all of them later, more work than copying the frame itself. The sender
instead keeps a pool of ``memfd`` segments (anonymous: no name in /dev/shm, gone when no process
holds them) and copies a frame into a free one, whose pages are already there; the receiver maps
the segment through ``/proc/<sender pid>/fd/<fd>`` and decodes the tensor from the mapping without
a copy.

Ownership is one byte at the start of each segment's header page: the sender sets it before it
copies, the receiver clears it when the last view of the mapping is gone (a ``weakref.finalize``
on the mapping, which lives exactly as long as any tensor decoded from it). A segment still held is
never reused; a frame that finds no free segment within ``MSTAR_SHM_POOL_BYTES`` (default 256 MiB,
0 disables the pool) goes through a one-shot /dev/shm file as before. The flag protocol relies on the
store order of x86-64 (and the system calls between a copy and the send).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass

import numpy as np

POOL_BYTES = int(os.environ.get("MSTAR_SHM_POOL_BYTES", 256 << 20))
HEADER = mmap.PAGESIZE  # page 0 of a segment: byte 0 is the in-use flag; the frame starts at page 1
MIN_SEGMENT = 1 << 20
PREFIX = b"pool:"


def pool_supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


@dataclass
class _Segment:
    fd: int
    size: int  # bytes a frame may use
    view: mmap.mmap  # the whole segment (header page + frame)


class ShmPool:
    """The sender's segments; ``put`` copies a frame into a free one."""

    def __init__(self, cap_bytes: int = POOL_BYTES) -> None:
        self.cap = cap_bytes if pool_supported() else 0
        self.id = uuid.uuid4().hex[:12]
        self.segments: list[_Segment] = []  # ascending size
        self.total = 0
        self._lock = threading.Lock()

    def put(self, frame: memoryview) -> bytes | None:
        """The reference to send instead of ``frame``, or None when no segment is free within the cap."""
        n = frame.nbytes
        with self._lock:
            seg = next((s for s in self.segments if s.size >= n and s.view[0] == 0), None)
            if seg is None:
                seg = self._grow(n)
                if seg is None:
                    return None
            seg.view[0] = 1
        dst = np.frombuffer(seg.view, dtype=np.uint8, count=n, offset=HEADER)
        np.copyto(dst, np.frombuffer(frame, dtype=np.uint8))
        return PREFIX + f"{self.id}:{os.getpid()}:{seg.fd}:{n}".encode()

    def _grow(self, n: int) -> _Segment | None:
        size = max(MIN_SEGMENT, 1 << (n - 1).bit_length())
        if self.total + size > self.cap:
            return None
        fd = os.memfd_create(f"mstar-pool-{self.id}", os.MFD_CLOEXEC)
        os.ftruncate(fd, HEADER + size)
        seg = _Segment(fd, size, mmap.mmap(fd, HEADER + size))
        self.segments.append(seg)
        self.segments.sort(key=lambda s: s.size)
        self.total += size
        return seg

    def close(self) -> None:
        """Drop this process's segments (receivers keep theirs mapped until they are done)."""
        with self._lock:
            for seg in self.segments:
                seg.view.close()
                os.close(seg.fd)
            self.segments.clear()
            self.total = 0


def _release(flag: mmap.mmap) -> None:
    if not flag.closed:
        flag[0] = 0


class ShmAttach:
    """The receiver's side: maps pooled frames and gives each segment back when it is no longer used."""

    def __init__(self) -> None:
        self._flags: dict[tuple[str, str], mmap.mmap] = {}  # (pool id, fd) -> its header page

    @staticmethod
    def is_pooled(ref: bytes) -> bool:
        return ref.startswith(PREFIX)

    def open(self, ref: bytes) -> memoryview:
        pool_id, pid, fd, n = ref[len(PREFIX):].decode().split(":")
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            flag = self._flags.get((pool_id, fd))
            if flag is None:
                flag = self._flags[(pool_id, fd)] = mmap.mmap(f, HEADER)
            data = mmap.mmap(f, int(n), offset=HEADER)
        finally:
            os.close(f)
        weakref.finalize(data, _release, flag)
        return memoryview(data)

    def close(self) -> None:
        """Unmap the header pages (a frame still in use keeps its segment busy for good)."""
        for flag in self._flags.values():
            flag.close()
        self._flags.clear()
