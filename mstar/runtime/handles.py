"""What a caller holds for a submitted request: ``RequestHandle`` (iterate it, sync or async, for
the streamed ``StreamItem`` s; ``result()`` for the ``RequestOutput``), ``RequestError``.

The conductor calls the handle's ``on_item`` / ``on_end`` (``RequestSink``) on the runtime's thread;
the handle logs the ``Emit`` message as it is (one list append; a wake-up only when a consumer
waits) and the consumer turns it into a ``StreamItem``, so the runtime's thread does the least per
item. Handles iterated on one event loop share a
``_LoopMailbox``: one wake-up of the loop per burst of items.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from mstar.graph.finish import FinishReason
from mstar.runtime.conductor import RequestStatus
from mstar.runtime.failures import FailureKind
from mstar.runtime.wire.messages import Emit, EmitRows

__all__ = ["RequestError", "RequestHandle", "RequestOutput", "StreamItem", "held_wakeups"]


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


@dataclass(repr=False)
class RequestOutput:
    """A request's end: its status and, in ``outputs``, every value emitted to it (edge name -> the
    values in emission order), gathered from the handle's log when first read, on the reader's thread."""

    request_id: str
    status: RequestStatus
    error: str | None = None
    failure: FailureKind | None = None  # why it did not finish (FAILED or ABORTED)
    finish_reason: FinishReason | None = None  # once it ended: STOP or LENGTH (FINISHED), ABORT, ERROR
    _log: list = field(default_factory=list, repr=False, compare=False)  # the handle's, complete once ended
    _outputs: dict | None = field(default=None, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def outputs(self) -> dict[str, list[list[torch.Tensor]]]:
        out = self._outputs
        if out is None:
            out = self._outputs = _gather(self._log)
        return out

    def __repr__(self) -> str:
        counts = {name: len(values) for name, values in self.outputs.items()}
        failure = "" if self.failure is None else f", failure={self.failure!r}"
        return (f"RequestOutput(request_id={self.request_id!r}, status={self.status!r}, error={self.error!r}"
                f"{failure}, outputs={{{', '.join(f'{k!r}: {n} values' for k, n in counts.items())}}})")

    def tensors(self, name: str) -> list[torch.Tensor]:
        """Every tensor emitted on ``name``, flattened in emission order."""
        return [t for value in self.outputs.get(name, []) for t in value]


_Row = tuple  # (EmitRows, row): one row of an ``EmitRows``, as a consumer takes it from a handle's log
# A handle's log holds such a row as its two parts, one after the other (appended together: no tuple
# kept per row and step, which the garbage collector would walk until the request ends).


_FINISH_OF_STATUS = {RequestStatus.FINISHED: FinishReason.STOP, RequestStatus.ABORTED: FinishReason.ABORT,
                     RequestStatus.FAILED: FinishReason.ERROR}


def _gather(log: list) -> dict[str, list[list[torch.Tensor]]]:
    """A handle's logged items as ``RequestOutput.outputs``."""
    outputs: dict[str, list] = {}
    name, values = None, None
    entries = iter(log)
    for entry in entries:  # (a loop of its own: every token of a long request)
        if type(entry) is EmitRows:  # a row of it (the index follows): its value, without making an Emit
            value = entry.value(next(entries))
            if entry.name != name:
                name = entry.name
                values = outputs.setdefault(name, [])
        elif entry is not None:
            value = entry.value
            if entry.name != name:
                name = entry.name
                values = outputs.setdefault(name, [])
        else:
            continue
        values.append(value)
    return outputs


def _emit_of(entry: Emit | _Row) -> Emit:
    return entry[0].emit(entry[1]) if type(entry) is tuple else entry


def _stream_item(entry: Emit | _Row) -> StreamItem:
    """The client's view of a logged item (built on the consumer's side, off the runtime's thread)."""
    ev = _emit_of(entry)
    return StreamItem(ev.name, ev.value, ev.modality, ev.node, ev.walk)


class _LoopMailbox:
    """Wake-ups of the handles iterated on one event loop, handed over in bursts: the driver thread
    appends a handle whose consumer waits, and only the first one since the loop last emptied the
    box schedules a wake-up (``call_soon_threadsafe``, a write to the loop's self-pipe). A decode
    step of 16 requests then wakes the loop once, not 16 times, and the loop thread takes the GIL
    from the runtime's thread once per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry's key: a strong reference would keep it forever
        self._lock = threading.Lock()
        self._woken: list[asyncio.Event] = []
        self._scheduled = False

    def post(self, event: asyncio.Event) -> None:
        with self._lock:
            self._woken.append(event)
            if self._scheduled:
                return
            self._scheduled = True
        if _held.active:  # inside ``held_wakeups``: scheduled when it ends, with the other loops'
            _held.boxes.append(self)
            return
        self._schedule()

    def _schedule(self) -> None:
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop collected")
            loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            with self._lock:
                self._woken.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            woken, self._woken = self._woken, []
            self._scheduled = False
        for event in woken:
            event.set()


class _HeldWakeups(threading.local):
    """Per thread: whether ``held_wakeups`` is active, and the mailboxes that wait for its end."""

    active = False

    def __init__(self) -> None:
        self.boxes: list[_LoopMailbox] = []


_held = _HeldWakeups()


class held_wakeups:  # noqa: N801  (a context manager, used like a function)
    """Within it, the calling thread's first post to a loop's mailbox schedules that loop's wake-up
    at the end instead of at once (one ``call_soon_threadsafe`` a loop per pass of deliveries).
    The loop can drain its box before the runtime's thread has delivered a burst of rows, so one
    burst would wake it several times: a write to its self-pipe (a system call that wakes another
    CPU) and the loop's thread taking the GIL, each time. The runtime's thread holds them over a
    pass of message deliveries (``drivers/local.py``); items are in the logs already, so a consumer that
    checks its log meanwhile reads them, and nothing waits past the pass's end."""

    def __enter__(self) -> None:
        _held.active = True

    def __exit__(self, *exc) -> None:
        _held.active = False
        boxes, _held.boxes = _held.boxes, []
        for box in boxes:
            box._schedule()


_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _LoopMailbox
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _LoopMailbox(loop)
        return box


class RequestHandle:
    """A submitted request: iterate it (sync or async) for its streamed items; ``result()`` for its
    ``RequestOutput`` once it ended.

    Every item delivered is appended to one log, in order (the end as a last ``None``); consumers
    read it through one shared cursor, so iterations of a handle go on where the previous one
    stopped. The runtime's thread only appends and, when a consumer waits, wakes it: a sync one
    through the handle's condition, an async one through its event loop's ``_LoopMailbox`` (no
    thread per waiting request, one wake-up of the loop per burst of items). The outputs of
    ``result()`` are gathered from the log when first read.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # every delivered item (an EmitRows row as two entries, ``_gather``); None last, once the request ended
        self._log: list[Emit | EmitRows | int | None] = []
        self._read = 0  # the consumers' shared cursor into the log
        self._output = RequestOutput(request_id, RequestStatus.WAITING, _log=self._log)
        self._done = threading.Event()
        self._cond = threading.Condition(threading.Lock())  # consumers' cursor and waits
        self._waiting = 0  # sync consumers waiting in ``_cond``
        self._mailbox: _LoopMailbox | None = None  # an async consumer's event loop
        self._wake: asyncio.Event | None = None  # set (on that loop) when the async consumer waits
        self._async_waiting = False

    # -- the conductor's side (``RequestSink``), called on the runtime's thread ---------------------
    # Lock-free: a consumer registers as waiting before it checks the log a last time, and the
    # runtime's thread appends before it reads the registration (each step atomic under the GIL), so
    # an item is either seen by that check or followed by a wake-up.
    def on_item(self, msg: Emit) -> None:
        self._log.append(msg)
        if self._waiting or self._async_waiting:
            self._notify()

    def on_row(self, rows: EmitRows, i: int) -> None:
        """Row ``i`` of ``rows`` is this request's item (kept as it is: made an ``Emit`` when read)."""
        self._log += (rows, i)  # both at once (one call under the GIL): a consumer never sees half
        if self._waiting or self._async_waiting:
            self._notify()

    def on_end(self, status: RequestStatus, error: str | None, failure: FailureKind | None,
               finish: FinishReason | None = None) -> None:
        out = self._output
        out.status, out.error, out.failure = status, error, failure
        out.finish_reason = finish or _FINISH_OF_STATUS[status]
        self._log.append(None)
        self._done.set()
        self._notify()

    def _notify(self) -> None:
        if self._waiting:
            with self._cond:
                self._cond.notify_all()
        if self._async_waiting:
            self._mailbox.post(self._wake)

    # -- the consumers' side --------------------------------------------------------------------
    def _take(self) -> Emit | _Row | None:
        """The next unread item (None: the end, which stays unread), or ``...`` when none is there
        yet. Holding ``_cond``."""
        log = self._log
        if self._read >= len(log):
            return ...
        ev = log[self._read]
        if type(ev) is EmitRows:  # a row: its index is the next entry
            self._read += 2
            return ev, log[self._read - 1]
        if ev is not None:
            self._read += 1
        return ev

    def _end_of_stream(self) -> None:
        if self._output.status is RequestStatus.FAILED:
            raise RequestError(f"request {self.request_id} failed: {self._output.error}",
                               self._output.failure or FailureKind.INTERNAL)

    def __iter__(self) -> Iterator[StreamItem]:
        if self._mailbox is not None:
            raise RuntimeError("this handle is being iterated asynchronously")
        while True:
            with self._cond:
                ev = self._take()
                if ev is ...:
                    self._waiting += 1
                    try:
                        while (ev := self._take()) is ...:
                            self._cond.wait()
                    finally:
                        self._waiting -= 1
            if ev is None:
                self._end_of_stream()
                return
            yield _stream_item(ev)

    async def __aiter__(self):
        if self._mailbox is None:
            self._wake = asyncio.Event()
            self._mailbox = _mailbox(asyncio.get_running_loop())
        wake = self._wake
        while True:
            with self._cond:
                ev = self._take()
            while ev is ...:
                wake.clear()
                self._async_waiting = True
                with self._cond:
                    ev = self._take()
                if ev is ...:
                    await wake.wait()
                self._async_waiting = False
            if ev is None:
                self._end_of_stream()
                return
            yield _stream_item(ev)

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._output

    @property
    def done(self) -> bool:
        return self._done.is_set()
