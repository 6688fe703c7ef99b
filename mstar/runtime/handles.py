"""What a caller holds for a submitted request: ``RequestHandle`` (iterate it, sync or async, for
the streamed ``StreamItem`` s; ``result()`` for the ``RequestOutput``), ``RequestError``.

The conductor calls the handle's ``on_item`` / ``on_end`` (``RequestSink``) on the runtime's thread;
the handle queues the ``Emit`` message as it is and the consumer turns it into a ``StreamItem``, so
the runtime's thread does the least per item. Handles iterated on one event loop share a
``_LoopMailbox``: one wake-up of the loop per burst of items.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.runtime.conductor import RequestStatus
from mstar.runtime.failures import FailureKind
from mstar.runtime.messages import Emit

__all__ = ["RequestError", "RequestHandle", "RequestOutput", "StreamItem"]


class RequestError(RuntimeError):
    """Raised while iterating a request that failed; ``kind`` says why (input, lost worker, ...)."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.INTERNAL) -> None:
        super().__init__(message)
        self.kind = kind


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
    failure: FailureKind | None = None  # why it did not finish (FAILED or ABORTED)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tensors(self, name: str) -> list[torch.Tensor]:
        """Every tensor emitted on ``name``, flattened in emission order."""
        return [t for value in self.outputs.get(name, []) for t in value]


def _stream_item(ev: Emit | None) -> StreamItem | None:
    """The client's view of an ``Emit`` (built on the consumer's side, off the runtime's thread)."""
    return None if ev is None else StreamItem(ev.name, ev.value, ev.modality, ev.node, ev.walk)


class _Events:
    """A handle's undelivered items for a synchronous consumer: an unbounded FIFO whose ``put_locked``
    (on the runtime's thread, once per item, holding ``lock``) only notifies when a consumer is
    waiting. ``lock`` is also the handle's: one lock per delivered item."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self._waiting = 0

    def put_locked(self, ev: Any) -> None:
        self._items.append(ev)
        if self._waiting:
            self._cond.notify()

    def put(self, ev: Any) -> None:
        with self.lock:
            self.put_locked(ev)

    def get(self) -> Any:
        with self._cond:
            while not self._items:
                self._waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            return self._items.popleft()

    def drain_locked(self) -> list:
        items = list(self._items)
        self._items.clear()
        return items


class _LoopMailbox:
    """Items for the handles iterated on one event loop, handed over in bursts: the driver thread
    appends, and only the first item since the loop last emptied the box schedules a wake-up
    (``call_soon_threadsafe``, a write to the loop's self-pipe). A decode step of 16 requests then
    wakes the loop once, not 16 times, and the loop thread takes the GIL from the runtime's thread
    once per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry's key: a strong reference would keep it forever
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Emit | None]] = []
        self._scheduled = False

    def post(self, aqueue: asyncio.Queue, ev: Emit | None) -> None:
        with self._lock:
            self._items.append((aqueue, ev))
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop collected")
            loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for aqueue, ev in items:
            aqueue.put_nowait(_stream_item(ev))


_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _LoopMailbox
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _LoopMailbox(loop)
        return box


class RequestHandle:
    """A submitted request: iterate it (sync or async) for its streamed items.

    Items also accumulate in ``result().outputs``. Async iteration binds the handle to the running
    event loop: the driver thread then hands items over through the loop's ``_LoopMailbox`` (no
    thread per waiting request, one wake-up per burst of items).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._events = _Events()  # Emit messages (None: the end) until a consumer takes them
        self._output = RequestOutput(request_id, RequestStatus.WAITING)
        self._done = threading.Event()
        self._lock = self._events.lock  # guards the switch to async delivery and the FIFO
        self._mailbox: _LoopMailbox | None = None
        self._aqueue: asyncio.Queue | None = None

    # -- the conductor's side (``RequestSink``), called on the runtime's thread ---------------------
    def on_item(self, msg: Emit) -> None:
        outputs = self._output.outputs
        values = outputs.get(msg.name)
        if values is None:
            values = outputs[msg.name] = []
        values.append(msg.value)
        with self._lock:
            if self._aqueue is not None:
                self._mailbox.post(self._aqueue, msg)
            else:
                self._events.put_locked(msg)

    def on_end(self, status: RequestStatus, error: str | None, failure: FailureKind | None) -> None:
        out = self._output
        out.status, out.error, out.failure = status, error, failure
        self._done.set()
        self._deliver(None)

    def _deliver(self, ev: Emit | None) -> None:
        with self._lock:
            if self._aqueue is not None:
                self._mailbox.post(self._aqueue, ev)
            else:
                self._events.put_locked(ev)

    def _end_of_stream(self) -> None:
        if self._output.status is RequestStatus.FAILED:
            raise RequestError(f"request {self.request_id} failed: {self._output.error}",
                               self._output.failure or FailureKind.INTERNAL)

    def __iter__(self) -> Iterator[StreamItem]:
        if self._aqueue is not None:
            raise RuntimeError("this handle is being iterated asynchronously")
        while True:
            ev = self._events.get()
            if ev is None:
                self._events.put(None)  # later iterations end at once too
                self._end_of_stream()
                return
            yield _stream_item(ev)

    async def __aiter__(self):
        with self._lock:
            if self._aqueue is None:
                self._mailbox = _mailbox(asyncio.get_running_loop())
                self._aqueue = asyncio.Queue()
                for ev in self._events.drain_locked():
                    self._aqueue.put_nowait(_stream_item(ev))
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
