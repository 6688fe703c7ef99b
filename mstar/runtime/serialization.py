"""The one serializer for everything that crosses a process boundary.

A message is encoded as a list of frames, ready for ``socket.send_multipart(frames, copy=False)``:

* frame 0 is a msgpack *header* that holds the whole structure;
* frames 1..n are the raw bytes of the tensors / arrays in the message, one frame each, in the
  order the header refers to them.  For a contiguous CPU tensor the frame is a ``memoryview``
  over the tensor's own memory (no copy); the memoryview keeps the tensor alive, so the frames
  stay valid while a zero-copy send is in flight.

Nothing is ever pickled: only the kinds listed below can be encoded, and decoding only ever
builds those kinds (plus the classes registered with :func:`register_message`).

Supported values, nested arbitrarily:

* ``None``, ``bool``, ``int`` (any size), ``float``, ``str``, ``bytes``;
* ``list``; ``tuple`` (decodes as a tuple); ``dict`` whose keys are ``str`` or ``int``;
* dataclasses registered with :func:`register_message` (decode to the same class with the same
  field values; the instance is rebuilt field by field *without* calling ``__init__`` /
  ``__post_init__``; fields missing from the message take their declared default, unknown
  fields are an error);
* ``enum.Enum`` subclasses registered with :func:`register_message` (sent by value);
* ``torch.Tensor`` on the CPU, strided layout, any shape (0-d and empty included) and the dtypes
  in :data:`TENSOR_DTYPES` (bfloat16, float16/32/64, complex64/128, bool, (u)int8..64, float8).
  Non-contiguous tensors are made contiguous (one copy), autograd history is dropped,
  subclasses such as ``nn.Parameter`` decode as plain tensors.  A tensor on another device
  is rejected: move it with ``.cpu()`` or send it through a device-to-device transport;
* ``numpy.ndarray`` (exact type) and numpy scalars with a numeric / bool dtype.

Only exact builtin types are accepted (a ``defaultdict``, a ``str`` subclass or an unregistered
dataclass is an error rather than silently changing type on the way).  The same tensor object
appearing several times in one message is sent once; the decoded tensors then share memory,
as the originals did.

Decoding tensors is zero-copy where possible: the tensor is a view (``torch.frombuffer``) of the
received frame.  A read-only frame (e.g. ``bytes``) is first copied into a ``bytearray`` so that
every decoded tensor / array is writable and writing it can never corrupt an immutable object;
a writable frame (``bytearray``, a ``zmq.Frame`` from ``recv_multipart(copy=False)``) is used in
place, unless its address is misaligned for the dtype, in which case the tensor is copied.

Caveat for in-process transports: over ``inproc://`` with ``copy=False`` the receiver's frame may
be the sender's own buffer, so a decoded tensor may alias the sender's tensor.

Errors: an object that cannot be encoded raises :class:`TypeError` naming its type and its path
in the message (``"cannot encode object of type Foo at msg.items[3].x"``); a value of a supported
type that cannot be sent (a CUDA tensor, an int dict key out of range, ...) raises
:class:`ValueError` with the path.  Any malformed input to :func:`decode` (wrong frame count,
unknown type tag, bad header, buffer size mismatch) raises :class:`DecodeError`, a
:class:`ValueError`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from mstar.runtime.message_registry import (
    _CLS_TO_TAG,
    _DC_FIELDS,
    _TAG_TO_CLS,
    is_registered,
    message_tag,
    register_message,
)

__all__ = [
    "DecodeError",
    "FORMAT_VERSION",
    "TENSOR_DTYPES",
    "decode",
    "encode",
    "encoded_nbytes",
    "is_registered",
    "message_tag",
    "register_message",
]

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


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


class _Fail(Exception):
    """Internal: an encode error on its way up; containers prepend their path segment."""

    def __init__(self, exc_type: type[Exception], template: str) -> None:
        super().__init__(template)
        self.exc_type = exc_type
        self.template = template  # contains "{path}"
        self.parts: list[str] = []  # innermost first


def _unsupported(obj: object, hint: str = "") -> _Fail:
    name = type(obj).__qualname__
    return _Fail(TypeError, f"cannot encode object of type {name} at {{path}}{hint}")


class _Encoder:
    __slots__ = ("buffers", "seen")

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.seen: dict[int, int] = {}  # id(tensor) -> buffer index

    def enc(self, obj: Any) -> Any:
        t = type(obj)
        if t is str or t is float or t is bool or obj is None or t is bytes:
            return obj
        if t is int:
            if _INT_MIN <= obj <= _INT_MAX:
                return obj
            return {_MARK: [_K_BIGINT, str(obj)]}
        if t is list:
            out = []
            for i, item in enumerate(obj):
                try:
                    out.append(self.enc(item))
                except _Fail as f:
                    f.parts.append(f"[{i}]")
                    raise
            return out
        if t is dict:
            return self.enc_dict(obj)
        if t is tuple:
            items = []
            for i, item in enumerate(obj):
                try:
                    items.append(self.enc(item))
                except _Fail as f:
                    f.parts.append(f"[{i}]")
                    raise
            return {_MARK: [_K_TUPLE, items]}
        tag = _CLS_TO_TAG.get(t)
        if tag is not None:
            if isinstance(obj, enum.Enum):
                try:
                    value = self.enc(obj.value)
                except _Fail as f:
                    f.parts.append(".value")
                    raise
                return {_MARK: [_K_ENUM, tag, value]}
            fields = {}
            for name, _, _, _ in _DC_FIELDS[t]:
                try:
                    fields[name] = self.enc(getattr(obj, name))
                except _Fail as f:
                    f.parts.append(f".{name}")
                    raise
            return {_MARK: [_K_DATACLASS, tag, fields]}
        if isinstance(obj, torch.Tensor):
            return self.enc_tensor(obj)
        if t is np.ndarray:
            return self.enc_ndarray(obj)
        if isinstance(obj, np.generic):
            if not _numpy_dtype_ok(obj.dtype):
                raise _unsupported(obj, f" (numpy dtype {obj.dtype} is not supported)")
            return {_MARK: [_K_NPSCALAR, obj.dtype.str, obj.tobytes()]}
        if isinstance(obj, enum.Enum) or dataclasses.is_dataclass(obj):
            raise _unsupported(obj, " (register the class with @register_message)")
        raise _unsupported(obj)

    def enc_dict(self, obj: dict) -> dict:
        out = {}
        for key, value in obj.items():
            kt = type(key)
            if kt is str:
                pass
            elif kt is int:
                if not _INT_MIN <= key <= _INT_MAX:
                    raise _Fail(ValueError, f"dict key {key} at {{path}} is out of the 64-bit range")
            else:
                raise _Fail(
                    TypeError,
                    f"cannot encode dict key of type {kt.__qualname__} at {{path}} (keys must be str or int)",
                )
            try:
                out[key] = self.enc(value)
            except _Fail as f:
                f.parts.append(f"[{key!r}]")
                raise
        return out

    def add_buffer(self, obj: object, make: Callable[[], memoryview]) -> int:
        key = id(obj)
        idx = self.seen.get(key)
        if idx is None:
            idx = len(self.buffers)
            self.buffers.append(make())
            self.seen[key] = idx
        return idx

    def enc_tensor(self, t: torch.Tensor) -> dict:
        if t.device.type != "cpu":
            raise _Fail(
                ValueError,
                f"cannot encode tensor on device {t.device} at {{path}}: only CPU tensors can be "
                f"serialized; move it with .cpu() first or send it through a device-to-device "
                f"transport",
            )
        if t.layout != torch.strided:
            raise _Fail(TypeError, f"cannot encode tensor with layout {t.layout} at {{path}} (strided only)")
        if t.is_quantized:
            raise _Fail(TypeError, "cannot encode quantized tensor at {path}")
        name = _TORCH_DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise _Fail(TypeError, f"cannot encode tensor of dtype {t.dtype} at {{path}}")
        idx = self.add_buffer(t, lambda: _tensor_bytes(t))
        return {_MARK: [_K_TENSOR, name, list(t.shape), idx]}

    def enc_ndarray(self, a: np.ndarray) -> dict:
        if not _numpy_dtype_ok(a.dtype):
            raise _unsupported(a, f" (numpy dtype {a.dtype} is not supported)")
        idx = self.add_buffer(a, lambda: _ndarray_bytes(a))
        return {_MARK: [_K_NDARRAY, a.dtype.str, list(a.shape), idx]}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()  # no-op (same tensor) when already contiguous
    # The numpy array keeps a reference to the tensor, and the memoryview to the array.
    return t.reshape(-1).view(torch.uint8).numpy().data


def _ndarray_bytes(a: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8).data


def encode(obj: Any) -> list[bytes | memoryview]:
    """Encode ``obj`` into frames: ``[header, buffer_1, ..., buffer_n]`` (see module docs).

    The buffer frames may be views of the tensors in ``obj``: do not modify those tensors
    until the frames have been sent.
    """
    encoder = _Encoder()
    try:
        root = encoder.enc(obj)
    except _Fail as f:
        path = "msg" + "".join(reversed(f.parts))
        raise f.exc_type(f.template.replace("{path}", path)) from None
    except RecursionError:
        raise ValueError("cannot encode message: nesting too deep or it contains a reference cycle") from None
    try:
        header = msgpack.packb([FORMAT_VERSION, len(encoder.buffers), root], use_bin_type=True)
    except (ValueError, UnicodeError) as e:  # e.g. a str with lone surrogates
        raise ValueError(f"cannot encode message header: {e}") from e
    frames: list[bytes | memoryview] = [header]
    frames.extend(encoder.buffers)
    return frames


def encoded_nbytes(frames: Sequence[Frame]) -> int:
    """Total payload size in bytes of a frame list (from :func:`encode` or received)."""
    total = 0
    for frame in frames:
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        if isinstance(buf, memoryview):
            total += buf.nbytes
        elif isinstance(buf, (bytes, bytearray)):
            total += len(buf)
        else:
            with memoryview(buf) as mv:
                total += mv.nbytes
    return total


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


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
