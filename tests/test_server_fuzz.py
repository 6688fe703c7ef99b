"""Hypothesis sends hostile JSON bodies (valid and broken fields, wrong types, NaN, huge numbers,
media that is not media) to every route of the toy model: no answer is a 5xx, every error has
OpenAI's shape, and the server is healthy and holds no KV block after. Derandomized and bounded
(50 examples a route), so the run is the same every time and takes a few seconds."""

import base64
import io
import json
import struct
import time
import zlib

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.helpers import kv_blocks_in_use
from tests.server_utils import running_server
from tests.toy_server_models import ToyChat

MODEL = "toy-chat"
EXAMPLES = 50
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server():
    with running_server(ToyChat(), MODEL) as (url, engine):
        yield url, engine
        _settled(engine)


def _settled(engine) -> None:
    """Every request ended (streams the client closed abort within a step) and freed its blocks."""
    deadline = time.monotonic() + 20
    while engine.runtime.stats()["running_requests"] or kv_blocks_in_use(engine.runtime):
        assert time.monotonic() < deadline, "requests or KV blocks left behind"
        time.sleep(0.02)


# -- values ------------------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
           | st.floats(allow_nan=True, allow_infinity=True))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _bomb() -> bytes:
    ihdr = struct.pack(">IIBBBBB", 30_000, 30_000, 1, 0, 0, 0, 0)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + crc


media_bytes = st.sampled_from([_png(3, 2), _bomb()]) | st.binary(max_size=64)
b64 = media_bytes.map(lambda b: base64.b64encode(b).decode()) | st.text(max_size=16)
small_int = st.integers(-3, 12) | st.sampled_from([0, 2**31, 2**63, 2**64, 10**30]) | junk
number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5) | junk

part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | junk}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.fixed_dictionaries({"url": b64.map(lambda s: "data:image/png;base64," + s)})
                           | junk}),
    st.fixed_dictionaries({"type": st.just("input_audio"),
                           "input_audio": st.fixed_dictionaries({"data": b64, "format": st.just("wav") | junk})}),
    junk,
)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | junk,
                                 "content": st.text(max_size=20) | st.lists(part, max_size=3) | junk})
model = st.just(MODEL) | junk
sampling = {"max_tokens": small_int, "temperature": number, "top_p": number, "top_k": small_int,
            "seed": small_int, "n": small_int, "stream": st.booleans() | junk}


def mutated(valid: st.SearchStrategy, hostile: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A valid body with up to two of its fields (or new ones) replaced by hostile values: most examples
    get past the schema, so the adapters, decoders and the model see the hostile values too."""
    keys = sorted(hostile)
    overrides = st.lists(st.sampled_from(keys), max_size=2, unique=True).flatmap(
        lambda ks: st.fixed_dictionaries({k: hostile[k] for k in ks}))
    return st.tuples(valid, overrides).map(lambda vo: {**vo[0], **vo[1]})


valid_content = st.text(min_size=1, max_size=8) | st.lists(part, min_size=1, max_size=2)
chat_bodies = mutated(
    st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 4),
                           "messages": st.tuples(valid_content).map(lambda c: [{"role": "user", "content": c[0]}]),
                           "stream": st.booleans()}),
    {**sampling, "model": model, "messages": st.lists(message, max_size=3) | junk,
     "modalities": st.sampled_from([["text", "audio"], ["image"]]) | junk, "audio": junk,
     "stop_token_ids": junk, "image_out": st.booleans() | junk, "stream_options": junk})
speech_bodies = mutated(
    st.fixed_dictionaries({"model": st.just(MODEL), "input": st.text(min_size=1, max_size=8),
                           "max_tokens": st.integers(1, 4),
                           "response_format": st.sampled_from(["wav", "pcm", "flac", "mp3", "opus", "aac"]),
                           "stream_format": st.sampled_from([None, "audio", "sse"])}),
    {"model": model, "input": junk, "voice": st.sampled_from(["alice", "zed"]) | junk, "response_format": junk,
     "stream_format": junk, "speed": number, "max_tokens": small_int, "seed": small_int, "temperature": number})
image_bodies = mutated(
    st.fixed_dictionaries({"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=8),
                           "n": st.integers(1, 2), "size": st.sampled_from(["8x8", "4x2"])}),
    {"model": model, "prompt": junk, "n": small_int, "seed": small_int, "response_format": junk,
     "size": st.sampled_from(["0x4", "1x99999", "9" * 30 + "x2", "8x8x8", "-8x8"]) | st.text(max_size=10) | junk})
tensor_obj = st.fixed_dictionaries({"dtype": st.sampled_from(["int64", "float32", "bfloat16"]) | junk,
                                    "shape": st.lists(st.integers(-2, 2**40), max_size=4) | junk, "data": b64})
token_lists = st.lists(st.integers(1, 29), min_size=1, max_size=6)
generate_bodies = mutated(
    st.fixed_dictionaries({"inputs": st.fixed_dictionaries({"input_ids": token_lists}),
                           "params": st.fixed_dictionaries({"max_tokens": st.integers(1, 4)})}),
    {"inputs": st.fixed_dictionaries({"input_ids": st.lists(st.integers(-2, 40), max_size=4) | tensor_obj | junk})
     | junk,
     "params": st.fixed_dictionaries({}, optional={"max_tokens": small_int,
                                                   "sampling": st.fixed_dictionaries({}, optional=sampling) | junk,
                                                   "extra": junk}) | junk})


# -- the check ---------------------------------------------------------------------------------------------


def _post(url: str, path: str, body) -> None:
    raw = json.dumps(body).encode()  # the stdlib writes NaN and Infinity literals: they must be a 400 too
    with httpx.stream("POST", url + path, content=raw, timeout=30,
                      headers={"content-type": "application/json"}) as r:
        data = r.read()
    assert r.status_code < 500, (path, body, data[:300])
    if r.status_code >= 400:
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
    assert b'"server_error"' not in data, (path, body, data[:300])  # no internal error event in a stream


@FUZZ
@given(body=chat_bodies)
def test_chat_never_5xx(server, body):
    _post(server[0], "/v1/chat/completions", body)


@FUZZ
@given(body=speech_bodies)
def test_speech_never_5xx(server, body):
    _post(server[0], "/v1/audio/speech", body)


@FUZZ
@given(body=image_bodies)
def test_images_never_5xx(server, body):
    _post(server[0], "/v1/images/generations", body)


@FUZZ
@given(body=generate_bodies)
def test_generate_never_5xx(server, body):
    _post(server[0], "/generate", body)


def test_server_healthy_after_the_fuzz(server):
    url, engine = server
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    _settled(engine)
