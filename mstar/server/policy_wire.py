"""openpi's msgpack-numpy wire format, written for untrusted input.

An array travels as the map ``{"__ndarray__": True, "data": <bytes>, "dtype": <numpy dtype str,
e.g. "<f4", "|u1">, "shape": [...]}`` and a numpy scalar as ``{"__npgeneric__": True, "data":
<value>, "dtype": <str>}`` (keys are msgpack bytes). Decoding accepts only bool, integer and float
dtypes, checks that the bytes match the shape, and bounds the element count before anything is
allocated; every problem is a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_ARRAY, _SCALAR = b"__ndarray__", b"__npgeneric__"
_KINDS = "biuf"  # no object, void, complex or string arrays from the network


class WireError(ValueError):
    """A frame that decodes as msgpack but holds a malformed array or scalar."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _KINDS:
            raise ValueError(f"cannot send arrays of dtype {obj.dtype}")
        return {_ARRAY: True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {_SCALAR: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def _dtype(value: Any) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or len(value) > 8:
        raise WireError(f"array dtype must be a short dtype string, got {value!r}")
    try:
        dt = np.dtype(value)
    except TypeError as e:
        raise WireError(f"unknown array dtype {value!r}") from e
    if dt.kind not in _KINDS:
        raise WireError(f"array dtype {dt} is not allowed (bool, integer or float only)")
    return dt


def _array(obj: dict, max_elements: int) -> np.ndarray:
    dt, data, shape = _dtype(obj.get(b"dtype")), obj.get(b"data"), obj.get(b"shape")
    if not isinstance(shape, (list, tuple)) or len(shape) > 8 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise WireError(f"array shape must be a list of at most 8 ints >= 0, got {shape!r}")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n > max_elements:
        raise WireError(f"array of shape {list(shape)} exceeds the limit of {max_elements} elements")
    if not isinstance(data, bytes) or len(data) != n * dt.itemsize:
        size = len(data) if isinstance(data, bytes) else type(data).__name__
        raise WireError(f"array data ({size}) does not match shape {list(shape)} of {dt}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def _scalar(obj: dict) -> np.generic:
    dt, data = _dtype(obj.get(b"dtype")), obj.get(b"data")
    if not isinstance(data, (bool, int, float)):
        raise WireError(f"numpy scalar data must be a number, got {type(data).__name__}")
    try:
        return dt.type(data)
    except (OverflowError, ValueError) as e:
        raise WireError(f"numpy scalar {data!r} does not fit {dt}") from e


def unpack(data: bytes, max_elements: int = 1 << 26) -> Any:
    """One frame -> Python values with numpy arrays (read-only views of the frame)."""
    def hook(obj: dict) -> Any:
        if obj.get(_ARRAY) is True:
            return _array(obj, max_elements)
        if obj.get(_SCALAR) is True:
            return _scalar(obj)
        return obj

    try:
        return msgpack.unpackb(data, object_hook=hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack's own errors (some without a message) for a bad frame
        detail = f": {e}" if str(e) else ""
        raise WireError(f"not a msgpack frame ({type(e).__name__}{detail})") from e
