"""Why a request ended: ``FinishReason``.

A dynamic loop's stop node may raise its stop flag as a ``FinishReason`` (a truthy value) rather than
``True``: the walk then reports that reason, and the runtime hands it to the client when the request
ends. A dynamic loop that runs out of iterations ends its walk with ``LENGTH``. The runtime itself
says ``ABORT`` (the request was cancelled) and ``ERROR`` (it failed).
"""

from __future__ import annotations

import enum

__all__ = ["FinishReason", "reason_of"]


class FinishReason(enum.StrEnum):
    """The values are OpenAI's ``finish_reason`` words where it has one."""

    STOP = "stop"  # the model ended it: a stop token, the end of its output
    LENGTH = "length"  # a token limit: the request's max_tokens, or the loop's bound
    ABORT = "abort"  # cancelled before it finished (a client gone, a stop string the client matched)
    ERROR = "error"  # it failed


def reason_of(flag: object) -> FinishReason | None:
    """The ``FinishReason`` a raised stop flag carries (the flag itself, or its only entry), else None."""
    if type(flag) is FinishReason:
        return flag
    if isinstance(flag, (list, tuple)) and len(flag) == 1 and type(flag[0]) is FinishReason:
        return flag[0]
    return None
