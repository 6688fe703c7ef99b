"""Int64 CPU tensors of Python ints, made and rewritten without going through ``torch.tensor``: the
runtime's per-batch indices (attention metadata, positions, seen tokens). ``long_tensor`` makes
one; ``HostLongs`` keeps one whose values are written again in place."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import torch

__all__ = ["HostLongs", "long_tensor"]


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """An int64 CPU tensor of Python ints, through an ``array`` (no per-element type inference as in
    ``torch.tensor``; the tensor holds the array's memory)."""
    buf = array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.zeros(0, dtype=torch.int64)


class HostLongs:
    """An int64 CPU tensor over an ``array`` of Python ints, written again in place by ``write``:
    plain CPython, no torch call. For values one forward reads and the next reads anew (the runtime's
    decode rows: their slots, context lengths, positions). Between two forwards of decode rows
    nothing else is torch work, so a new tensor there would be the first torch call after the
    forward, and pay for torch's cold code paths on every step."""

    __slots__ = ("buf", "tensor")

    def __init__(self, values: Iterable[int]) -> None:
        self.buf = array("q", values)
        self.tensor = torch.frombuffer(self.buf, dtype=torch.int64) if self.buf else torch.zeros(0, dtype=torch.int64)

    def write(self, values: Sequence[int]) -> bool:
        """The tensor's values replaced by ``values`` (True); False, with nothing changed, when their
        number differs."""
        buf = self.buf
        if len(values) != len(buf) or not buf:
            return False
        buf[:] = array("q", values)
        return True
