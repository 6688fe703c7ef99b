"""``mstar.client`` against an in-process server of the toy model: every route through the sync and
the async client, streaming, and errors as ``MStarAPIError`` with the OpenAI error body."""

import asyncio
import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.client import AsyncMStarClient, MStarAPIError, MStarClient, audio_part, image_part, user
from tests.server_utils import running_server
from tests.toy_models import TinyAttentionLM
from tests.toy_server_models import SAMPLES_PER_TOKEN, ToyChat, decode_token, encode_text

MODEL = "toy-chat"
REF = TinyAttentionLM(0)


def expected_text(prompt: str, n: int) -> str:
    return "".join(decode_token(t) for t in REF.reference_generate(encode_text(prompt), n))


@pytest.fixture(scope="module")
def server():
    with running_server(ToyChat(), MODEL, api_key="k") as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture
def client(url):
    with MStarClient(url, api_key="k") as c:
        yield c


def png(color=(10, 20, 30), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def wav(frames: int = 160) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x01" * frames)
    return buf.getvalue()


def test_system_routes(client):
    assert client.health() == {"status": "ok"}
    assert client.models() == [MODEL] and client.model == MODEL
    assert client.voices() == ["alice", "bob"]


def test_chat_text_images_and_audio_in(client):
    r = client.chat([user("hello")], max_tokens=6)
    assert r.text == expected_text("hello", 6) and r.finish_reason == "length"
    assert r.usage["completion_tokens"] == 6 and r.audio is None and r.images == []
    r = client.chat([user("look", image_part(png()), audio_part(wav()))], max_tokens=3)
    ids = encode_text("look") + [20 % 29 + 1, 2]  # the toy's tokens for an image of mean 20, one clip
    assert r.text == "".join(decode_token(t) for t in REF.reference_generate(ids, 3))


def test_chat_audio_and_image_out(client):
    r = client.chat([user("speak")], max_tokens=4, modalities=["text", "audio"], audio={"voice": "alice"})
    with wave.open(io.BytesIO(r.audio)) as w:
        assert w.getnframes() == 4 * SAMPLES_PER_TOKEN
    r = client.chat([user("draw")], max_tokens=2, image_out=True)
    assert r.text == expected_text("draw", 2)
    assert Image.open(io.BytesIO(r.images[0])).size == (4, 2)


def test_chat_stream(client):
    deltas = list(client.chat_stream([user("stream me")], max_tokens=7, modalities=["text", "audio"],
                                     stream_options={"include_usage": True}))
    assert "".join(d.text for d in deltas) == expected_text("stream me", 7)
    assert sum(len(d.audio) for d in deltas) == 7 * SAMPLES_PER_TOKEN * 2
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert deltas[-1].usage["completion_tokens"] == 7


def test_speech_whole_and_streamed(client):
    data = client.speech("hi there", voice="bob")
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnframes() == 6 * SAMPLES_PER_TOKEN
    chunks = list(client.speech_stream("hi there", voice="bob"))
    assert len(chunks) == 6 and b"".join(chunks) == data[44:]
    assert client.speech("hi there", response_format="flac")[:4] == b"fLaC"


def test_images_and_edits(client):
    imgs = client.images("a cat", n=2, size="16x8")
    assert [Image.open(io.BytesIO(b)).size for b in imgs] == [(16, 8), (16, 8)]
    (edited,) = client.image_edits(png(size=(4, 4)), "edit", size="8x8", seed=3)
    assert Image.open(io.BytesIO(edited)).size == (8, 8)


def test_generate_takes_torch_numpy_and_lists(client):
    ids = encode_text("native")
    want = REF.reference_generate(ids, 4)
    for inputs in (torch.tensor(ids), np.array(ids, dtype=np.int64), ids):
        items = client.generate({"input_ids": inputs}, {"max_tokens": 4})
        assert [int(i.tensors[0][0]) for i in items] == want
        assert {i.name for i in items} == {"token"} and items[0].walk == "prefill"


def test_errors_are_typed(url, client):
    with pytest.raises(MStarAPIError) as e:
        client.chat([user("x")], model="nope")
    assert e.value.status == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(MStarAPIError) as e:
        client.chat([user("x")], temperature=5)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert set(e.value.body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(MStarAPIError) as e:
        list(client.generate_stream({"input_ids": [1]}, {"max_tokens": "x"}))
    assert e.value.status == 400
    with pytest.raises(MStarAPIError) as e, MStarClient(url, api_key="wrong") as bad:
        bad.models()
    assert e.value.status == 401


def test_error_event_ending_a_stream_raises(server, client, monkeypatch):
    with pytest.raises(MStarAPIError, match="poison") as e:  # fails before the first chunk: a plain 400
        list(client.chat_stream([user("poison")], max_tokens=3))
    assert e.value.status == 400
    engine = server[1]
    make_decoder = engine.adapter.new_decoder

    def failing_decoder(route, req):
        decoder = make_decoder(route, req)
        feed = decoder.feed

        def feed_then_fail(name, value):
            if len(decoder.tokens) == 2:
                raise RuntimeError("decoder bug")
            return feed(name, value)

        decoder.feed = feed_then_fail
        return decoder

    monkeypatch.setattr(engine.adapter, "new_decoder", failing_decoder)
    received = []
    with pytest.raises(MStarAPIError) as e:  # fails after two chunks: the stream's last event
        for delta in client.chat_stream([user("x")], max_tokens=5):
            received.append(delta.text)
    assert e.value.status == 500 and e.value.code == "internal_error" and len("".join(received)) == 2


def test_async_client_mirrors_the_sync_one(url):
    async def run():
        async with AsyncMStarClient(url, api_key="k") as c:
            text = (await c.chat([user("async")], max_tokens=5)).text
            streamed = "".join([d.text async for d in c.chat_stream([user("async")], max_tokens=5)])
            audio = b"".join([chunk async for chunk in c.speech_stream("hi there")])
            imgs = await c.images("x", size="8x8")
            items = await c.generate({"input_ids": encode_text("native")}, {"max_tokens": 2})
            try:
                await c.speech("x", voice="zed")
            except MStarAPIError as e:
                error = e
            return text, streamed, audio, imgs, items, error

    text, streamed, audio, imgs, items, error = asyncio.run(run())
    assert text == streamed == expected_text("async", 5)
    assert len(audio) == 6 * SAMPLES_PER_TOKEN * 2 and len(imgs) == 1 and len(items) == 2
    assert error.status == 400 and error.param == "voice"
