"""Decoding of the one wire format (see ``serialization.py`` for what may be sent): frames ->
the value, tensors and arrays as zero-copy views of the received frames where possible; any
malformed input raises ``DecodeError``."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from mstar.runtime.wire.format import (
    _K_BIGINT,
    _K_DATACLASS,
    _K_ENUM,
    _K_NDARRAY,
    _K_NPSCALAR,
    _K_TENSOR,
    _K_TUPLE,
    _MARK,
    FORMAT_VERSION,
    TENSOR_DTYPES,
    DecodeError,
    Frame,
    _numpy_dtype_ok,
)
from mstar.runtime.wire.registry import _DC_FIELDS, _TAG_TO_CLS


class _Decoder:
    __slots__ = ("frames", "views", "u8")

    def __init__(self, frames: Sequence[Frame]) -> None:
        self.frames = frames
        self.views: dict[int, memoryview] = {}  # buffer index -> writable 1-D byte view
        self.u8: dict[int, torch.Tensor] = {}  # buffer index -> uint8 tensor over it

    def view(self, idx: Any) -> memoryview:
        mv = self.views.get(idx)
        if mv is not None:
            return mv
        if type(idx) is not int or not 0 <= idx < len(self.frames) - 1:
            raise DecodeError(f"buffer index {idx!r} out of range ({len(self.frames) - 1} buffers)")
        frame = self.frames[idx + 1]
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        mv = memoryview(buf)
        if mv.readonly or not mv.c_contiguous:
            mv = memoryview(bytearray(mv))  # the one copy: never hand out writable views of bytes
        elif mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        self.views[idx] = mv
        return mv

    def hook(self, d: dict) -> Any:
        if _MARK not in d:
            for k in d:
                if type(k) is not str and type(k) is not int:
                    raise DecodeError(f"invalid dict key {k!r} in message")
            return d
        if len(d) != 1:
            raise DecodeError("malformed tagged value in message header")
        node = d[_MARK]
        if type(node) is not list or not node:
            raise DecodeError("malformed tagged value in message header")
        kind = node[0]
        n = len(node)
        if kind == _K_TUPLE and n == 2 and type(node[1]) is list:
            return tuple(node[1])
        if kind == _K_DATACLASS and n == 3 and type(node[2]) is dict:
            return self.dataclass(node[1], node[2])
        if kind == _K_ENUM and n == 3:
            cls = _TAG_TO_CLS.get(node[1]) if type(node[1]) is str else None
            if cls is None or not issubclass(cls, enum.Enum):
                raise DecodeError(f"unknown enum type tag {node[1]!r} (is it registered?)")
            try:
                return cls(node[2])
            except (ValueError, TypeError) as e:
                raise DecodeError(f"invalid value {node[2]!r} for enum {node[1]!r}") from e
        if kind == _K_TENSOR and n == 4:
            return self.tensor(node[1], node[2], node[3])
        if kind == _K_NDARRAY and n == 4:
            return self.ndarray(node[1], node[2], node[3])
        if kind == _K_NPSCALAR and n == 3 and type(node[2]) is bytes:
            dt = _numpy_dtype(node[1])
            if len(node[2]) != dt.itemsize:
                raise DecodeError("numpy scalar size mismatch")
            return np.frombuffer(node[2], dtype=dt)[0]
        if kind == _K_BIGINT and n == 2 and type(node[1]) is str:
            try:
                return int(node[1])
            except ValueError as e:
                raise DecodeError("malformed big integer") from e
        raise DecodeError(f"malformed tagged value of kind {kind!r} in message header")

    def dataclass(self, tag: Any, values: dict) -> Any:
        cls = _TAG_TO_CLS.get(tag) if type(tag) is str else None
        if cls is None or cls not in _DC_FIELDS:
            raise DecodeError(
                f"unknown message type tag {tag!r} (is the class registered with @register_message "
                f"and its module imported in this process?)"
            )
        specs = _DC_FIELDS[cls]
        obj = cls.__new__(cls)
        used = 0
        for name, has_default, default, factory in specs:
            if name in values:
                value = values[name]
                used += 1
            elif has_default:
                value = default
            elif factory is not None:
                value = factory()
            else:
                raise DecodeError(f"message {tag!r} lacks required field {name!r}")
            object.__setattr__(obj, name, value)
        if used != len(values):
            known = {s[0] for s in specs}
            extra = sorted(str(k) for k in values if k not in known)
            raise DecodeError(f"message {tag!r} has unknown fields {extra}")
        return obj

    def tensor(self, dtype_name: Any, shape: Any, idx: Any) -> torch.Tensor:
        dtype = TENSOR_DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise DecodeError(f"unsupported tensor dtype {dtype_name!r}")
        numel = _check_shape(shape)
        mv = self.view(idx)
        itemsize = dtype.itemsize
        if mv.nbytes != numel * itemsize:
            raise DecodeError(
                f"tensor buffer {idx} has {mv.nbytes} bytes, expected {numel * itemsize} "
                f"for {dtype_name}{shape}"
            )
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        u8 = self.u8.get(idx)
        if u8 is None:
            u8 = torch.frombuffer(mv, dtype=torch.uint8)  # writable by construction: no warning
            self.u8[idx] = u8
        if u8.data_ptr() % min(itemsize, 8):
            u8 = u8.clone()  # misaligned for this dtype
        return u8.view(dtype).view(shape)

    def ndarray(self, dtype_str: Any, shape: Any, idx: Any) -> np.ndarray:
        dt = _numpy_dtype(dtype_str)
        numel = _check_shape(shape)
        mv = self.view(idx)
        if mv.nbytes != numel * dt.itemsize:
            raise DecodeError(f"array buffer {idx} has {mv.nbytes} bytes, expected {numel * dt.itemsize}")
        return np.frombuffer(mv, dtype=dt).reshape(shape)


def _numpy_dtype(s: Any) -> np.dtype:
    if type(s) is not str:
        raise DecodeError(f"invalid numpy dtype {s!r}")
    try:
        dt = np.dtype(s)
    except TypeError as e:
        raise DecodeError(f"invalid numpy dtype {s!r}") from e
    if not _numpy_dtype_ok(dt):
        raise DecodeError(f"unsupported numpy dtype {s!r}")
    return dt


def _check_shape(shape: Any) -> int:
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise DecodeError(f"invalid shape {shape!r}")
    return math.prod(shape)


def decode(frames: Sequence[Frame]) -> Any:
    """Decode frames produced by :func:`encode` (``bytes``, ``bytearray``, ``memoryview`` or
    ``zmq.Frame``-like objects with a ``.buffer``).  Raises :class:`DecodeError` on any
    malformed input.
    """
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or len(frames) < 1:
        raise DecodeError("expected a non-empty sequence of frames")
    head = frames[0]
    head = head.buffer if hasattr(head, "buffer") else head
    decoder = _Decoder(frames)
    unpacker = msgpack.Unpacker(
        None,
        raw=False,
        use_list=True,
        strict_map_key=False,
        object_hook=decoder.hook,
        max_buffer_size=max(memoryview(head).nbytes, 1),
    )
    try:
        unpacker.feed(head)
        if unpacker.read_array_header() != 3:
            raise DecodeError("malformed message header")
        version = unpacker.unpack()
        if version != FORMAT_VERSION:
            raise DecodeError(f"unsupported message format version {version!r} (expected {FORMAT_VERSION})")
        n_buffers = unpacker.unpack()
        if type(n_buffers) is not int or n_buffers != len(frames) - 1:
            raise DecodeError(f"message header announces {n_buffers!r} buffers but {len(frames) - 1} came")
        root = unpacker.unpack()
        try:
            unpacker.unpack()
        except msgpack.OutOfData:
            pass
        else:
            raise DecodeError("trailing data after message header")
    except DecodeError:
        raise
    except RecursionError:
        raise DecodeError("message nesting too deep") from None
    except Exception as e:  # msgpack format errors, OutOfData, bad types from a corrupt header
        raise DecodeError(f"malformed message header: {type(e).__name__}: {e}") from e
    return root
