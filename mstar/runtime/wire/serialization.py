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
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from mstar.runtime.wire.decode import decode
from mstar.runtime.wire.format import (
    _INT_MAX,
    _INT_MIN,
    _K_BIGINT,
    _K_DATACLASS,
    _K_ENUM,
    _K_NDARRAY,
    _K_NPSCALAR,
    _K_TENSOR,
    _K_TUPLE,
    _MARK,
    _TORCH_DTYPE_NAMES,
    FORMAT_VERSION,
    TENSOR_DTYPES,
    DecodeError,
    Frame,
    _numpy_dtype_ok,
)
from mstar.runtime.wire.registry import (
    _CLS_TO_TAG,
    _DC_FIELDS,
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
