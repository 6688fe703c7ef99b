"""Tests for mstar.runtime.wire.serialization (msgpack header + zero-copy tensor frames)."""

from __future__ import annotations

import enum
import math
import pickle
import warnings
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.runtime.wire.serialization import (
    TENSOR_DTYPES,
    DecodeError,
    decode,
    encode,
    encoded_nbytes,
    is_registered,
    message_tag,
    register_message,
)

# --------------------------------------------------------------------------------------------
# Registered test types
# --------------------------------------------------------------------------------------------


@register_message
class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@register_message
class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@register_message
class Perm(enum.Flag):
    R = 1
    W = 2
    X = 4


@register_message
class Shape(enum.Enum):
    SQUARE = (2, 2)
    LINE = (1, 3)


@register_message
@dataclass
class Inner:
    x: object = None
    label: str = ""


@register_message
@dataclass
class Outer:
    items: list
    meta: dict = field(default_factory=dict)


@register_message
@dataclass(frozen=True)
class Frozen:
    a: int
    b: tuple


@register_message
@dataclass
class Batch:
    request_ids: list[int]
    tensors: dict[str, list[torch.Tensor]]
    color: Color
    inner: Inner
    pair: tuple[Inner, Level]


@register_message(tag="Msg_v1")
@dataclass
class MsgV1:
    a: int


@register_message(tag="Msg_v2")
@dataclass
class MsgV2:
    a: int
    b: int = 5
    c: list = field(default_factory=lambda: [1])


@register_message(tag="Msg_v3")
@dataclass
class MsgV3:
    a: int
    z: int  # required, absent from MsgV1


@register_message(tag="Tag_aaaa")
@dataclass
class TagA:
    v: int = 0


@dataclass
class Unregistered:
    v: int = 0


class Foo:
    pass


@register_message
class BadEnum(enum.Enum):
    A = Foo()  # a member whose value cannot be encoded


def roundtrip(obj):
    return decode(encode(obj))


def roundtrip_bytes(obj):
    """Round trip through immutable ``bytes`` frames (what a copying transport yields)."""
    return decode([bytes(f) for f in encode(obj)])


def strict_equal(a, b) -> bool:
    """Equality that also checks types (True != 1, (1,) != [1]) and compares tensors exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return tensor_bits_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def tensor_bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def buffer_address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


# --------------------------------------------------------------------------------------------
# Plain values
# --------------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
keys = st.text(max_size=8) | st.integers(min_value=-(2**63), max_value=2**64 - 1)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=5).map(tuple)
        | st.dictionaries(keys, children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_hypothesis_nested_roundtrip(obj):
    out = roundtrip(obj)
    assert strict_equal(obj, out), (obj, out)
    frames = encode(obj)
    assert len(frames) == 1  # no tensors: the header only


@pytest.mark.parametrize(
    "obj",
    [
        None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**40, -(10**40),
        0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), "", "héllo ✓", b"", b"\x00\xff",
        [], (), {}, (1,), [(1, 2), [3, (4,)]], {"a": (1, [2])}, {1: "x", "1": "y", -5: None},
    ],
)  # fmt: skip
def test_scalar_and_container_roundtrip(obj):
    assert strict_equal(obj, roundtrip(obj))


def test_tuple_stays_tuple_and_list_stays_list():
    out = roundtrip({"t": (1, (2, 3)), "l": [1, [2, 3]]})
    assert type(out["t"]) is tuple and type(out["t"][1]) is tuple
    assert type(out["l"]) is list and type(out["l"][1]) is list


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def make_tensor(dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: random bit patterns
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype if dtype.itemsize > 1 else torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


ALL_DTYPES = sorted(TENSOR_DTYPES.values(), key=str)


def test_required_dtypes_supported():
    for dt in [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool, torch.int8,
               torch.int16, torch.int32, torch.int64, torch.uint8, torch.complex64, torch.complex128]:  # fmt: skip
        assert dt in ALL_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensor_dtype_roundtrip(dtype):
    t = make_tensor(dtype)
    for fn in (roundtrip, roundtrip_bytes):
        out = fn(t)
        assert type(out) is torch.Tensor
        assert out.dtype == dtype and out.shape == t.shape and out.device.type == "cpu"
        assert tensor_bits_equal(t, out)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex64], ids=str
)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (0, 0), (1,), (2, 1, 3)], ids=str)
def test_tensor_shapes(dtype, shape):
    t = make_tensor(dtype, shape)
    frames = encode(t)
    assert len(frames) == 2
    for fn in (roundtrip, roundtrip_bytes):
        out = fn(t)
        assert out.shape == t.shape and out.dtype == dtype
        assert tensor_bits_equal(t, out)
    assert roundtrip(t).shape == torch.Size(shape)


def test_zero_dim_tensor_value():
    out = roundtrip(torch.tensor(3.25, dtype=torch.float64))
    assert out.dim() == 0 and out.item() == 3.25


def test_bfloat16_exact_bits():
    # every bf16 bit pattern, NaN payloads and subnormals included
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16).reshape(256, 256)
    for fn in (roundtrip, roundtrip_bytes):
        out = fn(t)
        assert out.dtype == torch.bfloat16 and out.shape == (256, 256)
        assert torch.equal(out.view(torch.int16).reshape(-1), bits)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(24.0).reshape(4, 6)[:, ::2],
        lambda: torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4).permute(2, 0, 1),
        lambda: torch.arange(6.0).reshape(2, 3)[1:],  # contiguous with a storage offset
        lambda: torch.arange(3.0).expand(4, 3),  # stride 0
        lambda: torch.randn(3, 2, dtype=torch.complex64).conj(),  # lazy conjugate bit
        lambda: -torch.randn(3, 2, dtype=torch.complex64).conj().imag,  # lazy negative bit
    ],
)
def test_non_contiguous_and_views(make):
    t = make()
    out = roundtrip(t)
    assert out.is_contiguous()
    assert torch.equal(out, t.resolve_conj().resolve_neg())


def test_requires_grad_and_parameter():
    p = torch.nn.Parameter(torch.randn(3, 3))
    y = p * 2
    out = roundtrip({"p": p, "y": y})
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad
    assert torch.equal(out["p"], p.detach()) and torch.equal(out["y"], y.detach())


def test_encode_is_zero_copy_for_contiguous_tensor():
    t = torch.randn(64, 32)
    frames = encode(t)
    assert isinstance(frames[1], memoryview)
    assert buffer_address(frames[1]) == t.data_ptr()
    assert frames[1].nbytes == t.numel() * t.element_size()
    # the frame keeps the tensor's memory alive
    ptr = t.data_ptr()
    del t
    assert buffer_address(frames[1]) == ptr
    assert decode(frames).shape == (64, 32)


def test_encode_with_storage_offset_points_into_storage():
    base = torch.arange(100, dtype=torch.float32)
    t = base[10:20]
    frames = encode(t)
    assert buffer_address(frames[1]) == t.data_ptr() == base.data_ptr() + 40


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex128, torch.bool], ids=str
)
def test_decode_is_zero_copy_for_writable_frames(dtype):
    t = make_tensor(dtype, (16, 8))
    frames = [bytearray(f) for f in encode(t)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode(frames)
    start, size, item = buffer_address(frames[1]), len(frames[1]), out.element_size()
    assert start <= out.data_ptr() and out.data_ptr() + out.numel() * item <= start + size
    assert tensor_bits_equal(out, t)
    # truly shares memory with the frame
    out.view(-1)[0] = out.view(-1)[1]
    assert bytes(frames[1][:item]) == bytes(frames[1][item : 2 * item])


def test_readonly_frames_are_copied_and_writable():
    t = torch.arange(12, dtype=torch.float32)
    frames = [bytes(f) for f in encode(t)]
    original = frames[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer would warn on a read-only buffer
        out = decode(frames)
    out += 100  # must be safe: never writes into the immutable bytes object
    assert frames[1] == original == t.numpy().tobytes()
    assert torch.equal(out, t + 100)
    # read-only memoryview too
    out2 = decode([memoryview(bytes(f)) for f in encode(t)])
    out2.zero_()
    assert torch.equal(out2, torch.zeros(12))


def test_misaligned_frame_decodes_correctly():
    t = torch.randn(10, dtype=torch.float64)
    header, payload = encode(t)
    big = bytearray(len(payload) + 1)
    big[1:] = payload
    out = decode([header, memoryview(big)[1:]])
    assert torch.equal(out, t)
    assert out.data_ptr() % 8 == 0


def test_same_tensor_twice_is_sent_once_and_shares_memory():
    t = torch.randn(4)
    frames = encode({"a": t, "b": [t], "c": t.clone()})
    assert len(frames) == 3
    out = decode([bytearray(f) for f in frames])
    assert torch.equal(out["a"], t) and torch.equal(out["b"][0], t) and torch.equal(out["c"], t)
    out["a"][0] = 42.0
    assert out["b"][0][0] == 42.0 and out["c"][0] != 42.0


def test_device_tensor_rejected_with_hint():
    t = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=r"device meta at msg\['x'\]\[0\].*\.cpu\(\)"):
        encode({"x": [t]})
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"cuda.*\.cpu\(\)"):
            encode(torch.zeros(2, device="cuda"))


def test_sparse_tensor_rejected():
    with pytest.raises(TypeError, match="layout"):
        encode(torch.eye(3).to_sparse())


# --------------------------------------------------------------------------------------------
# numpy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(12, dtype=np.int16).reshape(3, 4).T,
        np.array(7, dtype=np.int64),
        np.zeros((0, 5), dtype=np.complex64),
        np.array([True, False]),
        np.arange(5, dtype=">u4"),
        np.arange(6, dtype=np.float16)[::2],
    ],
    ids=lambda a: f"{a.dtype.str}{a.shape}",
)
def test_numpy_roundtrip(arr):
    for fn in (roundtrip, roundtrip_bytes):
        out = fn(arr)
        assert type(out) is np.ndarray and out.dtype == arr.dtype and out.shape == arr.shape
        np.testing.assert_array_equal(out, arr)
        assert out.flags.writeable


def test_numpy_scalars():
    for v in [np.float32(1.5), np.int8(-3), np.bool_(True), np.uint64(2**64 - 1), np.complex128(1 + 2j)]:
        out = roundtrip(v)
        assert type(out) is type(v) and out == v


def test_numpy_object_dtype_rejected():
    with pytest.raises(TypeError, match=r"ndarray at msg\[1\]"):
        encode([1, np.array([object()], dtype=object)])
    with pytest.raises(TypeError, match="str_"):
        encode(np.str_("x"))


# --------------------------------------------------------------------------------------------
# Dataclasses and enums
# --------------------------------------------------------------------------------------------


def test_nested_dataclasses_with_dicts_of_lists_of_tensors():
    t1, t2 = torch.randn(2, 3), torch.arange(5)
    msg = Batch(
        request_ids=[1, 2, 3],
        tensors={"k": [t1, t2], "v": [], "bf": [torch.ones(2, dtype=torch.bfloat16)]},
        color=Color.GREEN,
        inner=Inner(x={"deep": [Inner(x=torch.zeros(0, 4), label="e")]}, label="i"),
        pair=(Inner(x=(1, 2)), Level.HIGH),
    )
    for fn in (roundtrip, roundtrip_bytes):
        out = fn(msg)
        assert type(out) is Batch
        assert out.request_ids == [1, 2, 3]
        assert list(out.tensors) == ["k", "v", "bf"]
        assert torch.equal(out.tensors["k"][0], t1) and torch.equal(out.tensors["k"][1], t2)
        assert out.tensors["v"] == []
        assert out.tensors["bf"][0].dtype == torch.bfloat16
        assert out.color is Color.GREEN
        deep = out.inner.x["deep"][0]
        assert type(deep) is Inner and deep.label == "e" and deep.x.shape == (0, 4)
        assert type(out.pair) is tuple and out.pair[0] == Inner(x=(1, 2)) and out.pair[1] is Level.HIGH


def test_dataclass_equality_and_frozen():
    f = Frozen(a=1, b=(Inner(x=[1.5]), None))
    out = roundtrip(f)
    assert type(out) is Frozen and out == f
    with pytest.raises(AttributeError):
        out.a = 2  # still frozen


def test_dataclass_default_factory_not_shared():
    out = roundtrip(Outer(items=[1]))
    assert out == Outer(items=[1], meta={})


@pytest.mark.parametrize("member", [Color.RED, Level.LOW, Perm.R | Perm.X, Perm(0), Shape.LINE])
def test_enums(member):
    out = roundtrip({"m": member})["m"]
    assert out is member or (type(out) is type(member) and out == member)


def test_int_enum_not_confused_with_int():
    out = roundtrip([Level.LOW, 1])
    assert out[0] is Level.LOW and type(out[1]) is int


def test_registration_api():
    assert is_registered(Batch) and message_tag(Batch) == "Batch"
    assert message_tag(MsgV1) == "Msg_v1"
    assert not is_registered(Unregistered)
    assert register_message(Batch) is Batch  # same class again: no-op


def test_duplicate_tag_raises():
    def make():
        @dataclass
        class Dup:
            v: int

        return Dup

    a, b = make(), make()
    assert a.__qualname__ == b.__qualname__
    register_message(a)
    with pytest.raises(ValueError, match="already used"):
        register_message(b)
    with pytest.raises(ValueError, match="already used"):
        register_message(tag="Msg_v1")(b)
    with pytest.raises(ValueError, match="already registered"):
        register_message(tag="another-tag")(a)


def test_register_non_dataclass_raises():
    with pytest.raises(TypeError):
        register_message(Foo)


def test_schema_evolution_defaults_and_unknown_fields():
    # Same-length tags let us retag a message: a newer receiver fills defaults ...
    header, *rest = encode(MsgV1(a=3))
    out = decode([header.replace(b"Msg_v1", b"Msg_v2"), *rest])
    assert out == MsgV2(a=3, b=5, c=[1])
    # ... an unknown field or a missing required field is an error.
    header, *rest = encode(MsgV2(a=3))
    with pytest.raises(DecodeError, match="unknown fields"):
        decode([header.replace(b"Msg_v2", b"Msg_v1"), *rest])
    header, *rest = encode(MsgV1(a=3))
    with pytest.raises(DecodeError, match="required field 'z'"):
        decode([header.replace(b"Msg_v1", b"Msg_v3"), *rest])


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_unknown_type_error_names_type_and_path():
    msg = Outer(items=[0, 1, 2, Inner(x=Foo())])
    with pytest.raises(TypeError, match=r"^cannot encode object of type Foo at msg\.items\[3\]\.x$"):
        encode(msg)
    with pytest.raises(TypeError, match=r"type Foo at msg\['a'\]\[1\]\[0\]"):
        encode({"a": (0, [Foo()])})
    with pytest.raises(TypeError, match=r"type Foo at msg\[7\]\.value"):
        encode({7: BadEnum.A})
    with pytest.raises(TypeError, match=r"type Foo at msg$"):
        encode(Foo())


def _holder(v):
    return v


def test_unknown_type_errors_misc():
    with pytest.raises(TypeError, match=r"Unregistered at msg\[0\].*register_message"):
        encode([Unregistered()])
    with pytest.raises(TypeError, match=r"type set at msg"):
        encode({1, 2})
    with pytest.raises(TypeError, match="bytearray"):
        encode(bytearray(b"x"))
    with pytest.raises(TypeError, match=r"dict key of type tuple at msg\['x'\]"):
        encode({"x": {(1, 2): 3}})
    with pytest.raises(TypeError, match=r"dict key of type float"):
        encode({1.5: 3})


def test_lambda_raises_and_pickle_never_used(monkeypatch):
    with pytest.raises(TypeError, match=r"type function at msg\['f'\]"):
        encode({"f": lambda x: x})
    with pytest.raises(TypeError, match="type function"):
        encode(Inner(x=_holder))

    def boom(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, boom)
    msg = Batch([1], {"k": [torch.ones(2)]}, Color.RED, Inner(np.arange(3)), (Inner(), Level.LOW))
    frames = encode(msg)
    assert b"test_serialization" not in frames[0] and b"torch" not in frames[0]  # no pickled class paths
    assert decode(frames).color is Color.RED


def test_unregistered_tag_raises_value_error():
    header, *rest = encode(TagA(v=1))
    bad = header.replace(b"Tag_aaaa", b"Tag_zzzz")
    with pytest.raises(ValueError, match="Tag_zzzz"):
        decode([bad, *rest])


def test_wrong_frame_count_raises():
    frames = encode({"a": torch.ones(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="buffers"):
        decode(frames[:-1])
    with pytest.raises(ValueError, match="buffers"):
        decode([*frames, b"extra"])
    with pytest.raises(ValueError):
        decode([])
    with pytest.raises(ValueError, match="buffers"):
        decode([encode(1)[0], b"x"])


def test_malformed_input_raises_value_error():
    header, payload = encode(torch.ones(4))
    for bad in [b"", b"\xc1", b"\x93\x01", header[:-1], header + b"\x00", msgpack.packb([99, 0, None]),
                msgpack.packb({"a": 1}), msgpack.packb([1, 0, {b"$": [77]}]),
                msgpack.packb([1, 0, {b"junk": 1}]), msgpack.packb([1, 0, {b"$": [3, "float32", [-1], 0]}])]:  # fmt: skip
        with pytest.raises(ValueError):
            decode([bad])
    with pytest.raises(ValueError, match="bytes"):
        decode([header, bytes(payload)[:-4]])  # size mismatch
    with pytest.raises(DecodeError, match="dtype"):
        decode([msgpack.packb([1, 1, {b"$": [3, "object", [1], 0]}]), b"12345678"])


def test_cycle_raises_value_error():
    a: list = []
    a.append(a)
    with pytest.raises(ValueError, match="cycle"):
        encode(a)


# --------------------------------------------------------------------------------------------
# Transport helpers and a real zmq round trip
# --------------------------------------------------------------------------------------------


def test_encoded_nbytes():
    t = torch.randn(10, 10)
    frames = encode({"t": t, "s": "x"})
    assert encoded_nbytes(frames) == len(frames[0]) + 400
    assert encoded_nbytes([bytes(f) for f in frames]) == encoded_nbytes(frames)
    assert encoded_nbytes([]) == 0


class _FakeFrame:
    def __init__(self, data):
        self.buffer = memoryview(bytearray(data))


def test_decode_frame_like_objects():
    t = torch.randn(5, 5)
    frames = [_FakeFrame(f) for f in encode([t, "x"])]
    out = decode(frames)
    assert torch.equal(out[0], t) and out[1] == "x"
    assert encoded_nbytes(frames) == sum(len(bytes(f.buffer)) for f in frames)


def test_zmq_pair_inproc_roundtrip():
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://mstar-serialization-test")
        b.connect("inproc://mstar-serialization-test")
        big = torch.randn(256, 256)  # 256 KiB: above pyzmq's copy threshold
        msg = Batch(
            request_ids=[7],
            tensors={"kv": [big, torch.arange(3, dtype=torch.int8)], "bf": [big.to(torch.bfloat16)]},
            color=Color.RED,
            inner=Inner(x=torch.tensor(True), label="zmq"),
            pair=(Inner(), Level.LOW),
        )
        frames = encode(msg)
        a.send_multipart(frames, copy=False)
        assert b.poll(5000)
        received = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in received)
        assert encoded_nbytes(received) == encoded_nbytes(frames)
        out = decode(received)
        assert type(out) is Batch and out.inner.label == "zmq" and out.color is Color.RED
        assert torch.equal(out.tensors["kv"][0], big)
        assert torch.equal(out.tensors["kv"][1], torch.arange(3, dtype=torch.int8))
        assert torch.equal(out.tensors["bf"][0].view(torch.int16), big.to(torch.bfloat16).view(torch.int16))
        assert out.inner.x.dim() == 0 and out.inner.x.item() is True
        # zero copy on receipt: the big tensor is a view of the received zmq frame
        kv_idx = next(i for i, f in enumerate(received) if len(f.buffer) == big.numel() * 4)
        start = buffer_address(received[kv_idx].buffer)
        assert start <= out.tensors["kv"][0].data_ptr() < start + len(received[kv_idx].buffer)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_a_walk_end_sends_its_finish_reason_by_value():
    from mstar.graph import FinishReason
    from mstar.runtime.wire.messages import WalkDone

    msg = roundtrip(WalkDone("r", "p", "decode", {"stop": [FinishReason.STOP, None]}, {}, FinishReason.LENGTH))
    assert msg.finish is FinishReason.LENGTH and msg.state["stop"][0] is FinishReason.STOP
