"""Chunk policies: when a streaming consumer fires, and what each firing contains.

A producer component streams *items* (opaque Python objects: tokens, tensors, frames)
to a consumer component of the same request.  The consumer does not fire once per
item; a :class:`ChunkPolicy` decides when it fires and which items each firing
(a :class:`Chunk`) contains.  There is one policy instance per (request, connection),
built by a zero-argument factory, e.g.::

    factory = lambda: SlidingWindowChunkPolicy(window=28, stride=7)

Terminology and invariants shared by every policy in this module
(``stream`` is the concatenation of every item ever pushed, indexed from 0):

* Each chunk is a contiguous slice of the stream:
  ``chunk.items == tuple(stream[chunk.start:chunk.end])``.  Items are passed through
  by reference, never copied or inspected.
* ``chunk.items[:chunk.num_context]`` are *context* items already delivered earlier;
  ``chunk.items[chunk.num_context:]`` are *new* items.  Over the whole stream
  (push chunks followed by finish chunks), concatenating the new items of every chunk
  gives back the stream exactly: every item is delivered as new exactly once, in order.
* Firing depends only on the number of items pushed so far, never on how the stream
  was split into ``push`` calls; a chunk fires during the ``push`` that delivers its
  last item (as early as possible), and several chunks may fire from one ``push``.
* Chunks returned by :meth:`ChunkPolicy.push` are never final.  :meth:`ChunkPolicy.finish`
  returns at most one chunk, and when it returns one it has ``is_final=True``.
* A policy only retains items it can still deliver (as new items or as context):
  :attr:`ChunkPolicy.buffered` never exceeds :attr:`ChunkPolicy.max_buffered` between
  calls, whatever the stream length, and drops to 0 after ``finish``.
* When ``finish`` returns ``[]`` (nothing left to deliver), the last chunk that fired
  from ``push`` is not marked final; the runtime learns of the end of the stream from
  :attr:`ChunkPolicy.done`.  :class:`FixedChunkPolicy` with ``continue_after_done=True``
  instead always reports the end with an (possibly empty) final chunk.

Policies are not thread-safe; a policy is driven by one request's loop.
This module is pure Python (standard library only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Chunk",
    "ChunkPolicy",
    "ChunkPolicyFactory",
    "FixedChunkPolicy",
    "LeftContextChunkPolicy",
    "SlidingWindowChunkPolicy",
]


@dataclass(frozen=True)
class Chunk:
    """One firing of the consumer.

    Attributes:
        items: the items delivered in this firing, in stream order
            (``items == stream[start:start + len(items)]``).
        start: stream index of ``items[0]`` (0-based position in the whole stream);
            for an empty chunk, the stream length at the time it fired.
        new_start: stream index of the first item not delivered in any earlier chunk;
            ``start <= new_start <= start + len(items)``.
        is_final: True for the last chunk of the stream (returned by ``finish``).
    """

    items: tuple
    start: int
    new_start: int
    is_final: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.items, tuple):
            object.__setattr__(self, "items", tuple(self.items))
        if self.start < 0:
            raise ValueError(f"Chunk.start must be >= 0, got {self.start}")
        if not self.start <= self.new_start <= self.start + len(self.items):
            raise ValueError(
                f"Chunk.new_start must lie in [start, start + len(items)] = "
                f"[{self.start}, {self.start + len(self.items)}], got {self.new_start}"
            )

    @property
    def end(self) -> int:
        """Stream index one past the last item (``start + len(items)``)."""
        return self.start + len(self.items)

    @property
    def num_context(self) -> int:
        """Number of leading items repeated from earlier chunks (``new_start - start``)."""
        return self.new_start - self.start

    @property
    def num_new(self) -> int:
        """Number of items delivered for the first time (``end - new_start``)."""
        return self.end - self.new_start

    @property
    def context_items(self) -> tuple:
        """The leading context items, ``items[:num_context]``."""
        return self.items[: self.num_context]

    @property
    def new_items(self) -> tuple:
        """The items delivered for the first time, ``items[num_context:]``."""
        return self.items[self.num_context :]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class ChunkPolicy(ABC):
    """Base class: buffers pushed items and cuts them into :class:`Chunk` objects.

    Subclasses describe a policy with two hooks:

    * :meth:`_context_start` -- the stream index of the first item that a chunk emitted
      *now* would contain.  It must be non-decreasing over time and never exceed the
      number of items delivered so far.  The buffer always holds exactly
      ``stream[_context_start():total]`` between calls (this is what bounds memory).
    * :meth:`_next_fire_after` -- given the stream count at which a chunk just fired,
      the stream count at which the next one fires (strictly larger).  The first
      threshold is passed to ``__init__``.

    A chunk fired when the stream count reaches a threshold ``T`` is
    ``stream[_context_start():T]`` with ``new_start`` = the count delivered before it.
    ``finish`` flushes ``stream[_context_start():total]`` if undelivered items remain.
    """

    def __init__(self, first_fire: int) -> None:
        self._buf: list = []
        self._buf_start = 0  # stream index of self._buf[0]
        self._total = 0  # items pushed so far
        self._delivered = 0  # items delivered as new so far (stream[:delivered])
        self._next_fire = first_fire  # stream count at which the next chunk fires
        self._done = False

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _context_start(self) -> int:
        """Stream index of the first item a chunk emitted now would contain."""

    @abstractmethod
    def _next_fire_after(self, fired_at: int) -> int:
        """Stream count at which the chunk after the one fired at ``fired_at`` fires."""

    @property
    @abstractmethod
    def max_buffered(self) -> int:
        """Upper bound on :attr:`buffered` between calls, for any stream."""

    def _finish_empty(self) -> list[Chunk]:
        """Chunks returned by ``finish`` when every item was already delivered."""
        return []

    # ---------------------------------------------------------------- public
    @property
    def done(self) -> bool:
        """True once :meth:`finish` has been called."""
        return self._done

    @property
    def total(self) -> int:
        """Number of items pushed so far (the stream length)."""
        return self._total

    @property
    def delivered(self) -> int:
        """Number of items delivered as new so far; they are ``stream[:delivered]``."""
        return self._delivered

    @property
    def pending(self) -> int:
        """Items pushed but not yet delivered as new (``total - delivered``)."""
        return self._total - self._delivered

    @property
    def buffered(self) -> int:
        """Number of items the policy still holds (<= :attr:`max_buffered`; 0 after finish)."""
        return len(self._buf)

    def push(self, items: Sequence | Iterable) -> list[Chunk]:
        """Append ``items`` to the stream and return the chunks that fire now.

        Returns zero, one or several non-final chunks, in stream order.  A chunk is
        returned by the push that brings the stream count to its firing threshold.
        Raises RuntimeError after :meth:`finish`.
        """
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.push() called after finish()")
        seq = items if isinstance(items, (list, tuple)) else list(items)
        out: list[Chunk] = []
        i, n = 0, len(seq)
        while i < n:
            take = min(n - i, self._next_fire - self._total)
            self._buf.extend(seq[i : i + take])
            i += take
            self._total += take
            if self._total == self._next_fire:
                fired_at = self._total
                out.append(self._emit(is_final=False))
                nxt = self._next_fire_after(fired_at)
                if nxt <= fired_at:  # pragma: no cover - guards against a buggy subclass
                    raise AssertionError(f"next firing threshold {nxt} must exceed {fired_at}")
                self._next_fire = nxt
            self._trim()
        return out

    def finish(self) -> list[Chunk]:
        """Mark the end of the stream and return the final flush chunk(s).

        Returns ``[]`` or a single chunk with ``is_final=True``.  After this call
        :attr:`done` is True, the buffer is released, and both :meth:`push` and
        :meth:`finish` raise RuntimeError.
        """
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.finish() called twice")
        self._done = True
        if self._total > self._delivered:
            out = [self._emit(is_final=True)]
        else:
            out = self._finish_empty()
        self._buf = []
        self._buf_start = self._total
        return out

    # -------------------------------------------------------------- internals
    def _emit(self, is_final: bool) -> Chunk:
        start = self._context_start()
        chunk = Chunk(
            items=tuple(self._buf[start - self._buf_start :]),
            start=start,
            new_start=self._delivered,
            is_final=is_final,
        )
        self._delivered = self._total
        return chunk

    def _trim(self) -> None:
        keep_from = self._context_start()
        drop = keep_from - self._buf_start
        if drop > 0:
            del self._buf[:drop]
            self._buf_start = keep_from

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._params()}; total={self._total}, "
            f"delivered={self._delivered}, buffered={self.buffered}, done={self._done})"
        )

    def _params(self) -> str:
        return ""


ChunkPolicyFactory = Callable[[], ChunkPolicy]
"""Zero-argument callable building a fresh policy for one (request, connection)."""


class FixedChunkPolicy(ChunkPolicy):
    """Fire every ``chunk_size`` new items; each chunk is exactly those items.

    Invariants: chunks never overlap (``num_context == 0``); every chunk from ``push``
    has exactly ``chunk_size`` items and fires when the stream count reaches
    ``chunk_size, 2*chunk_size, ...``.  ``buffered <= chunk_size``.

    ``finish``:
      * if items remain undelivered, they fire as one final chunk (1..chunk_size items);
      * otherwise, with ``continue_after_done=True`` it returns exactly one *empty* final
        chunk (``items=()``, ``start == new_start == total``): the consumer is told the
        stream ended, e.g. so a talker can keep generating after the thinker finished.
        So with ``continue_after_done=True`` ``finish`` always returns exactly one chunk;
      * otherwise (``continue_after_done=False``) it returns ``[]``; the last chunk from
        ``push`` is then not marked final, and the runtime learns end-of-stream from
        :attr:`done`.
    """

    def __init__(self, chunk_size: int, continue_after_done: bool = False) -> None:
        self.chunk_size = _check_int("chunk_size", chunk_size, 1)
        self.continue_after_done = bool(continue_after_done)
        super().__init__(first_fire=self.chunk_size)

    def _context_start(self) -> int:
        return self._delivered

    def _next_fire_after(self, fired_at: int) -> int:
        return fired_at + self.chunk_size

    @property
    def max_buffered(self) -> int:
        return self.chunk_size

    def _finish_empty(self) -> list[Chunk]:
        if self.continue_after_done:
            return [Chunk(items=(), start=self._total, new_start=self._total, is_final=True)]
        return []

    def _params(self) -> str:
        return f"chunk_size={self.chunk_size}, continue_after_done={self.continue_after_done}"


class SlidingWindowChunkPolicy(ChunkPolicy):
    """Overlapping windows of ``window`` items advancing by ``stride`` items.

    The first chunk fires when the stream count reaches ``window`` and is
    ``stream[0:window]`` (``new_start == 0``).  Chunk ``k`` (k >= 1) fires when the
    count reaches ``window + k*stride`` and is ``stream[k*stride : k*stride + window]``
    with ``new_start == start + window - stride`` (its last ``stride`` items are new).
    This is Orpheus TTS audio streaming (window 28 codec tokens, stride 7: each window
    is decoded and its middle part emitted).

    Invariants: every chunk from ``push`` has exactly ``window`` items and the starts of
    consecutive chunks from ``push`` differ by exactly ``stride``; a final chunk from
    ``finish`` that follows a fired window starts 1..stride-1 items after it.
    ``buffered == min(total, window)`` (the last ``window`` items), so
    ``buffered <= window``.

    ``finish``:
      * if the stream has 1..window-1 items in total, one final chunk with all of them
        (``start == new_start == 0``);
      * if items arrived after the last window fired (never delivered), one final chunk
        with the last ``window`` items, ``stream[total-window:total]``, whose
        ``new_start`` marks the first never-delivered item;
      * if nothing is undelivered (including an empty stream), ``[]``.
    """

    def __init__(self, window: int, stride: int) -> None:
        self.window = _check_int("window", window, 1)
        self.stride = _check_int("stride", stride, 1)
        if self.stride > self.window:
            raise ValueError(f"stride must be <= window, got stride={stride} > window={window}")
        super().__init__(first_fire=self.window)

    def _context_start(self) -> int:
        return max(0, self._total - self.window)

    def _next_fire_after(self, fired_at: int) -> int:
        return fired_at + self.stride

    @property
    def max_buffered(self) -> int:
        return self.window

    def _params(self) -> str:
        return f"window={self.window}, stride={self.stride}"


class LeftContextChunkPolicy(ChunkPolicy):
    """Fire every ``chunk`` new items, prefixed by up to ``left_context`` earlier items.

    Chunk ``k`` fires when the stream count reaches ``(k+1)*chunk`` and is
    ``stream[max(0, k*chunk - left_context) : (k+1)*chunk]`` with
    ``new_start == k*chunk``: fewer context items at the start of the stream.  This is
    Qwen3-Omni's codec decoding (25 new frames with 25 frames of left context to warm
    up the causal convolutions).

    ``first_chunk`` (default ``chunk``): the first chunk's new items; each later one doubles
    the previous size until it reaches ``chunk`` (5, 10, 20, 25, 25, ... for ``first_chunk=5``),
    so the first output comes early and later chunks grow about as fast as a faster-than-real-time
    consumer plays what it has.

    Invariants: ``items[:num_context] == stream[max(0, new_start - left_context):new_start]``;
    every chunk from ``push`` has exactly the scheduled number of new items (``chunk`` without
    ``first_chunk``); ``buffered <= chunk + left_context``.

    ``finish``: the remaining new items (fewer than the next chunk's), if any, fire with their
    left context as one final chunk; otherwise ``[]``.
    """

    def __init__(self, chunk: int, left_context: int, first_chunk: int | None = None) -> None:
        self.chunk = _check_int("chunk", chunk, 1)
        self.left_context = _check_int("left_context", left_context, 0)
        self.first_chunk = self.chunk if first_chunk is None else _check_int("first_chunk", first_chunk, 1)
        if self.first_chunk > self.chunk:
            raise ValueError(f"first_chunk ({self.first_chunk}) must be at most chunk ({self.chunk})")
        super().__init__(first_fire=self.first_chunk)
        self._size = self.first_chunk  # new items of the chunk that fires next

    def _context_start(self) -> int:
        return max(0, self._delivered - self.left_context)

    def _next_fire_after(self, fired_at: int) -> int:
        self._size = min(self.chunk, 2 * self._size)
        return fired_at + self._size

    @property
    def max_buffered(self) -> int:
        return self.chunk + self.left_context

    def _params(self) -> str:
        first = f", first_chunk={self.first_chunk}" if self.first_chunk != self.chunk else ""
        return f"chunk={self.chunk}, left_context={self.left_context}{first}"
