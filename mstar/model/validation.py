"""Checks of plain values that configs and requests of every family share (pure Python, no torch)."""

from __future__ import annotations

__all__ = ["check_int"]


def check_int(value: object, what: str, lo: int = 1, hi: int | None = None) -> int:
    """``value`` itself when it is an int (a bool is not) in ``[lo, hi]`` (``hi`` None: no upper bound);
    otherwise ``ValueError("<what> must be an int >= <lo>, got ...")`` (``"in [lo, hi]"`` with a bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        wanted = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{what} must be an int {wanted}, got {value!r}")
    return value
