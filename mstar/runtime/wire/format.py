"""The wire format shared by ``serialization.encode`` and ``decode.decode``: the header
layout, the kind markers of non-native values, integer bounds and the dtypes that may be sent.

header = msgpack array [FORMAT_VERSION, n_buffers, root]. Plain None/bool/int/float/str/bytes/
list/dict map to msgpack natively (dict keys: str/int). Anything else becomes a one-entry map
{_MARK: [kind, ...]}; _MARK is a bytes key, which no plain dict can contain.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT_VERSION", "TENSOR_DTYPES", "DecodeError", "Frame"]

FORMAT_VERSION = 1


Frame = Any  # bytes | bytearray | memoryview | zmq.Frame (anything with a ``.buffer``)


class DecodeError(ValueError):
    """Raised by :func:`decode` for any malformed or unknown input."""


# --------------------------------------------------------------------------------------------
# Wire format
# --------------------------------------------------------------------------------------------
#
# header = msgpack array [FORMAT_VERSION, n_buffers, root]
# Plain None/bool/int/float/str/bytes/list/dict map to msgpack natively (dict keys: str/int).
# Anything else becomes a one-entry map {_MARK: [kind, ...]}; _MARK is a bytes key, which no
# plain dict can contain.

_MARK = b"$"
_K_TUPLE = 0  # [K, items]
_K_DATACLASS = 1  # [K, tag, {field: value}]
_K_ENUM = 2  # [K, tag, value]
_K_TENSOR = 3  # [K, dtype name, shape, buffer index]
_K_NDARRAY = 4  # [K, numpy dtype str, shape, buffer index]
_K_NPSCALAR = 5  # [K, numpy dtype str, raw bytes]
_K_BIGINT = 6  # [K, decimal str]

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


def _torch_dtypes() -> dict[str, torch.dtype]:
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    ]  # fmt: skip
    out = {}
    for name in names:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            out[name] = dt
    return out


#: dtype name on the wire -> torch dtype, for every tensor dtype that can be sent.
TENSOR_DTYPES: dict[str, torch.dtype] = _torch_dtypes()
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TENSOR_DTYPES.items()}

_NUMPY_KINDS = frozenset("biufc")


def _numpy_dtype_ok(dt: np.dtype) -> bool:
    return dt.kind in _NUMPY_KINDS and not dt.hasobject and dt.fields is None and dt.subdtype is None
