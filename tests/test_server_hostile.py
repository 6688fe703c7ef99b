"""Hostile input never yields a 5xx: decompression bombs, media that is not what it claims, tensors
of absurd shapes, numbers out of range; every one is a 400 in OpenAI's error shape, the server stays
healthy and holds no KV block after. Internal errors are logged with their request id and traceback,
and the client gets the id, never the traceback."""

import base64
import io
import json
import logging
import random
import struct
import wave
import zlib

import httpx
import pytest
from PIL import Image

from mstar.model.adapter import ItemDecoder, TextDelta
from mstar.server import media
from tests.helpers import kv_blocks_in_use
from tests.server_utils import running_server
from tests.toy_server_models import ToyChat

MODEL = "toy-chat"


@pytest.fixture(scope="module")
def server():
    with running_server(ToyChat(), MODEL) as (url, engine):
        yield url, engine


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG of a few hundred bytes whose header declares ``width`` x ``height`` pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def png(size=(4, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (9, 9, 9)).save(buf, format="PNG")
    return buf.getvalue()


def noisy_png() -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3)).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(rate=16000, channels=1, frames=b"\x00\x01" * 8) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def image_part(raw: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(raw)}}


def audio_part(raw: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": "wav"}}


def chat(content, **extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def tensor(dtype="int64", shape=(1,), data="AQAAAAAAAAA=") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data": data}


def nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def generate(inputs=None, **params) -> tuple[str, dict]:
    return "/generate", {"inputs": inputs or {"input_ids": [1, 2]}, "params": params}


CASES = {
    "bomb in chat": (chat([image_part(png_declaring(30_000, 30_000))]), "exceeds the limit"),
    "too many pixels": (chat([image_part(png_declaring(5000, 5000))]), "exceeds the limit"),
    "too long a side": (chat([image_part(png_declaring(20_000, 1))]), "per side"),
    "zero-size image": (chat([image_part(png_declaring(0, 5))]), "image"),
    "base64 not an image": (chat([image_part(b"just some text")]), "cannot decode image"),
    "truncated png": (chat([image_part(noisy_png()[:2000])]), "cannot decode image"),
    "too many images": (chat([image_part(png())] * 17), "at most 16"),
    "wav of 0 Hz": (chat([audio_part(wav_bytes(rate=16000)[:24] + struct.pack("<I", 0) + wav_bytes()[28:])]),
                    "sample rate"),
    "8-bit wav": (chat([audio_part(wav_bytes()[:34] + struct.pack("<H", 8) + wav_bytes()[36:])]), "16-bit"),
    "top_p 0": (chat("x", top_p=0), "top_p"),
    "top_k huge": (chat("x", top_k=10**30), "top_k"),
    "seed past 64 bits": (chat("x", seed=2**80), "seed"),
    "max_tokens past the bound": (chat("x", max_tokens=2**70), "max_tokens"),
    "n of 2": (chat("x", n=2), "n"),
    "stop_token_ids not a list": (chat("x", stop_token_ids=5), "stop_token_ids"),
    "extra field past 64 bits": (chat("x", cfg_renorm_min=2**70), "64 bits"),
    # OpenAI fields with no effect yet: refused, never accepted and ignored
    "logprobs": (chat("x", logprobs=True, top_logprobs=2), "logprobs is not supported by toy-chat"),
    "presence_penalty": (chat("x", presence_penalty=0.5), "presence_penalty is not supported by toy-chat"),
    "frequency_penalty": (chat("x", frequency_penalty=2.0), "frequency_penalty is not supported by toy-chat"),
    "logit_bias": (chat("x", logit_bias={"5": 100}), "logit_bias is not supported by toy-chat"),
    "response_format json": (chat("x", response_format={"type": "json_object"}), "response_format is not"),
    "tools": (chat("x", tools=[{"type": "function", "function": {"name": "f"}}]), "tools is not supported by toy-chat"),
    "tool_choice": (chat("x", tool_choice="required"), "tool_choice is not supported by toy-chat"),
    "speed 10": (("/v1/audio/speech", {"model": MODEL, "input": "x", "speed": 10}), "speed"),
    "speech max_tokens list": (("/v1/audio/speech", {"model": MODEL, "input": "x", "max_tokens": [1]}),
                               "max_tokens"),
    "flac streamed": (("/v1/audio/speech", {"model": MODEL, "input": "x", "response_format": "flac",
                                            "stream_format": "audio"}), "streaming supports"),
    "size of 20 digits": (("/v1/images/generations", {"model": MODEL, "prompt": "x",
                                                      "size": "99999999999999999999x2"}), "size"),
    "size past the side limit": (("/v1/images/generations", {"model": MODEL, "prompt": "x", "size": "20000x2"}),
                                 "size"),
    "unicode digits in size": (("/v1/images/generations", {"model": MODEL, "prompt": "x", "size": "\u00b2x2"}),
                               "size"),
    "images seed past 64 bits": (("/v1/images/generations", {"model": MODEL, "prompt": "x", "seed": 2**64}), "seed"),
    "tensor of 2^80 elements": (generate({"input_ids": tensor(shape=(2**40, 2**40), data="")}), "elements"),
    "tensor of 9 dims": (generate({"input_ids": tensor(shape=(1,) * 9)}), "at most 8"),
    "tensor dtype a list": (generate({"input_ids": {"dtype": ["int64"], "shape": [1], "data": ""}}), "dtype"),
    "tensor shape a string": (generate({"input_ids": tensor(shape="ab")}), "shape"),
    "tensor shape negative": (generate({"input_ids": tensor(shape=(-1,))}), "shape"),
    "tensor data short": (generate({"input_ids": tensor(data="AAAA")}), "bytes"),
    "numbers past 64 bits": (generate({"input_ids": [2**70]}), "not a tensor"),
    "ragged lists": (generate({"input_ids": [[1, 2], [3]]}), "not a tensor"),
    "a string tensor": (generate({"input_ids": "abc"}), "not a tensor"),
    "params.max_tokens a string": (generate(max_tokens="x"), "max_tokens"),
    "params.sampling a number": (generate(sampling=5), "sampling"),
    "params.sampling.temperature -1": (generate(sampling={"temperature": -1}), "temperature"),
    "params int past 64 bits": (generate(height=2**64), "64 bits"),
    "params nested too deep": (generate(deep=nested(20)), "deep"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_a_400(server, name):
    (path, body), fragment = CASES[name]
    r = httpx.post(server[0] + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert fragment in error["message"] + str(error["param"]), error


def test_no_op_values_of_unsupported_fields_are_accepted(server):
    """What SDKs and tools send by default (``logprobs: false``, zero penalties, an empty bias, plain
    text format, no tools) is not refused: only a value that asks for something is."""
    _, body = chat("x", max_tokens=2, logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0,
                   logit_bias={}, response_format={"type": "text"}, tools=[], tool_choice="none")
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_nan_literal_in_the_json_body_is_a_400(server):
    raw = b'{"model": "toy-chat", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    r = httpx.post(server[0] + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("image, fragment", [(png_declaring(30_000, 30_000), "exceeds the limit"),
                                             (b"not an image at all", "cannot decode image")],
                         ids=["bomb", "not an image"])
def test_image_edit_with_a_hostile_upload_is_a_400(server, image, fragment):
    r = httpx.post(server[0] + "/v1/images/edits", data={"model": MODEL, "prompt": "x"},
                   files={"image": ("x.png", image, "image/png")}, timeout=30)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_image_edit_extras_are_bounded(server):
    r = httpx.post(server[0] + "/v1/images/edits", data={"model": MODEL, "prompt": "x", "seed": str(2**70)},
                   files={"image": ("x.png", png(), "image/png")}, timeout=30)
    assert r.status_code == 400 and "64 bits" in r.json()["error"]["message"]


def test_a_chunked_body_past_the_limit_is_a_413(server):
    """No content-length to refuse up front: the body is counted as it arrives."""
    def megabytes(n):
        for _ in range(n):
            yield b"x" * (1 << 20)

    r = httpx.post(server[0] + "/generate", content=megabytes(33), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_server_is_healthy_and_holds_no_blocks_after_hostile_input(server):
    url, engine = server
    for name in ("bomb in chat", "tensor of 2^80 elements", "params.sampling a number"):
        (path, body), _ = CASES[name]
        assert httpx.post(url + path, json=body, timeout=30).status_code == 400
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    ok = httpx.post(url + "/v1/chat/completions", json=chat("fine", max_tokens=2)[1], timeout=30)
    assert ok.status_code == 200
    assert kv_blocks_in_use(engine.runtime) == 0


def test_decoders_bound_before_decoding():
    with pytest.raises(ValueError, match="exceeds the limit"):
        media.decode_image(png_declaring(30_000, 30_000), "x", 4096 * 4096)
    with pytest.raises(ValueError, match="limit of 10 samples"):
        media.decode_wav(wav_bytes(frames=b"\x00\x00" * 11), "x", max_samples=10)
    pcm, rate = media.decode_wav(wav_bytes(channels=2, frames=struct.pack("<4h", 2, 4, -6, -8)), "x")
    assert rate == 16000 and pcm.tolist() == [3, -7]  # channels averaged
    with pytest.raises(ValueError, match="elements"):
        media.tensor_from_json(tensor(shape=(1 << 14, 1 << 14)), "x", max_elements=1 << 20)


def test_a_handler_bug_is_a_logged_500_without_traceback(server, monkeypatch, caplog):
    url, engine = server

    def broken(body, images, audio):
        raise RuntimeError("adapter bug")

    monkeypatch.setattr(engine.adapter, "chat_request", broken)
    with caplog.at_level(logging.ERROR, logger="mstar.server"):
        r = httpx.post(url + "/v1/chat/completions", json=chat("x")[1], timeout=30,
                       headers={"x-request-id": "req-123"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "req-123"
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "req-123" in error["message"] and "Traceback" not in r.text and "adapter bug" not in r.text
    logged = [rec for rec in caplog.records if "req-123" in rec.getMessage()]
    assert logged and logged[0].exc_info[1].args == ("adapter bug",)


def test_a_failure_mid_stream_ends_with_an_error_event(server, monkeypatch, caplog):
    url, engine = server
    make_decoder = engine.adapter.new_decoder

    class Failing(ItemDecoder):
        def __init__(self, route, req):
            self.inner, self.n = make_decoder(route, req), 0

        def feed(self, name, value):
            self.n += 1
            if self.n == 3:
                raise RuntimeError("decoder bug")
            return [TextDelta("a")]

        def finish(self):
            return []

    monkeypatch.setattr(engine.adapter, "new_decoder", Failing)
    with caplog.at_level(logging.ERROR, logger="mstar.server"):
        r = httpx.post(url + "/v1/chat/completions", json=chat("x", max_tokens=6, stream=True)[1], timeout=30)
    events = [e[6:] for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and r.headers["x-request-id"] in error["message"]
    assert any(rec.exc_info and rec.exc_info[1].args == ("decoder bug",) for rec in caplog.records)


def test_every_response_names_its_request_id(server):
    r = httpx.get(server[0] + "/health", timeout=30)
    assert len(r.headers["x-request-id"]) == 16
    r = httpx.get(server[0] + "/health", timeout=30, headers={"x-request-id": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"


# -- the same through a real family's adapter: bagel-tiny ------------------------------------------------


@pytest.fixture(scope="module")
def bagel():
    from mstar.models.bagel.model import BagelTiny

    with running_server(BagelTiny(), "bagel-tiny") as (url, engine):
        yield url, engine


@pytest.mark.parametrize("image, fragment", [(png_declaring(30_000, 30_000), "exceeds the limit"),
                                             (b"GIF89a but not really", "cannot decode image")],
                         ids=["bomb", "not an image"])
def test_bagel_edit_and_chat_with_hostile_images_are_400s(bagel, image, fragment):
    url, engine = bagel
    r = httpx.post(url + "/v1/images/edits", data={"model": "bagel-tiny", "prompt": "x"},
                   files={"image": ("x.png", image, "image/png")}, timeout=60)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]
    body = {"model": "bagel-tiny", "messages": [{"role": "user", "content": [image_part(image)]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]
    assert kv_blocks_in_use(engine.runtime) == 0


def test_bagel_non_finite_and_oversized_numbers_are_400s(bagel):
    url, _ = bagel
    raw = b'{"model": "bagel-tiny", "prompt": "x", "size": "8x8", "guidance_scale": Infinity}'
    r = httpx.post(url + "/v1/images/generations", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "guidance_scale: inf is not a finite number"
    body = {"model": "bagel-tiny", "messages": [{"role": "user", "content": "x"}], "modalities": ["image"],
            "cfg_renorm_min": 2**70}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "64 bits" in r.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
