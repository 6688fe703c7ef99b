"""Why a request failed, as a named kind that travels with the failure.

Workers classify the exception where it happens (``FailureKind.of``); the kind crosses the wire
inside ``RequestFailed`` and reaches the caller on ``RequestOutput.failure`` and ``RequestError``.
The server maps kinds to HTTP statuses in one table, so no code ever searches an error message.
"""

from __future__ import annotations

from enum import StrEnum

from mstar.runtime.wire.registry import register_message


@register_message
class FailureKind(StrEnum):
    INPUT = "input"  # the request itself is bad (a ValueError raised by model code)
    WORKER_LOST = "worker_lost"  # a worker process died while the request was in flight (or a peer it
    # exchanges with directly, e.g. a tensor-parallel rank: a ConnectionError)
    OUT_OF_MEMORY = "out_of_memory"  # KV blocks or host memory ran out
    INTERNAL = "internal"  # anything else: a bug, reported as such
    ABORTED = "aborted"  # the caller (or shutdown) ended the request

    @classmethod
    def of(cls, error: BaseException) -> FailureKind:
        """Classify an exception raised while serving a request (its cause chain included)."""
        seen: BaseException | None = error
        while seen is not None:
            if isinstance(seen, KVCacheExhausted | MemoryError):
                return cls.OUT_OF_MEMORY
            if isinstance(seen, ValueError):
                return cls.INPUT
            if isinstance(seen, ConnectionError):
                return cls.WORKER_LOST
            seen = seen.__cause__
        return cls.INTERNAL


class KVCacheExhausted(RuntimeError):
    """A batch could not get the KV blocks it needs."""


def describe(error: BaseException) -> str:
    """The text a failure carries: exception type and message."""
    return f"{type(error).__name__}: {error}"
