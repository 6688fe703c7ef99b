"""The HTTP API with the official OpenAI client and httpx: every route, streaming framing, media,
errors in OpenAI's shape, disconnects, overload, metrics."""

import asyncio
import base64
import io
import json
import struct
import time
import wave

import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.helpers import kv_blocks_in_use
from tests.server_utils import get, running_server
from tests.toy_models import TinyAttentionLM, ToyLM
from tests.toy_server_models import SAMPLES_PER_TOKEN, ToyChat, decode_token, encode_text

MODEL = "toy-chat"
REF = TinyAttentionLM(0)


def expected_text(prompt: str, n: int) -> str:
    return "".join(decode_token(t) for t in REF.reference_generate(encode_text(prompt), n))


@pytest.fixture(scope="module")
def server():
    with running_server(ToyChat(), MODEL) as (url, engine):
        yield url, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def png_data_url(color=(10, 20, 30), size=(8, 6)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_health_and_models(server, client):
    url, _ = server
    assert get(url, "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming_matches_reference(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6)
    assert r.choices[0].message.content == expected_text("hello", 6)
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 11


def test_chat_streaming_sync_and_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "stream me"}],
                                            max_tokens=7, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("stream me", 7)
    assert chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_async_client(server):
    async def run():
        ac = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
        out = []
        stream = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "async"}],
                                                  max_tokens=5, stream=True)
        async for c in stream:
            out.append(c.choices[0].delta.content or "")
        await ac.close()
        return "".join(out)

    assert asyncio.run(run()) == expected_text("async", 5)


def test_sse_framing(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "frame"}], "max_tokens": 3, "stream": True}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == payloads[0]["id"] for p in payloads)


def test_chat_with_image_and_audio_input(client):
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x01" * 160)
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": png_data_url()}},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(),
                                                       "format": "wav"}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=3)
    ids = encode_text("look") + [20 % 29 + 1, 2]  # image mean 20 -> token 21; one audio clip -> token 2
    assert r.choices[0].message.content == "".join(decode_token(t) for t in REF.reference_generate(ids, 3))


def test_chat_audio_output_one_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "speak"}], max_tokens=4,
                                       modalities=["text", "audio"], audio={"voice": "alice", "format": "wav"})
    assert len(r.choices) == 1
    msg = r.choices[0].message
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert w.getframerate() == 24000 and w.getnframes() == 4 * SAMPLES_PER_TOKEN
    assert msg.audio.transcript == msg.content == expected_text("speak", 4)


@pytest.mark.parametrize("bad, fragment", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "invalid base64"),
    ({"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}, "only data URLs"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}},
     "cannot decode image"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"}},
     "cannot decode WAV"),
])
def test_bad_media_is_400(server, bad, fragment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, bad]}]}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_error_shapes(server, client):
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10_000)
    r = httpx.post(server[0] + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_failed_request_is_400_and_others_unaffected(client):
    with pytest.raises(openai.BadRequestError, match="poison"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "poison"}], max_tokens=3)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fine"}], max_tokens=3)
    assert r.choices[0].message.content == expected_text("fine", 3)


def _wav_ok(data: bytes, samples: int):
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == samples


def test_speech_formats_and_streaming(server):
    url = server[0]
    body = {"model": MODEL, "input": "hi there", "voice": "bob"}
    r = httpx.post(url + "/v1/audio/speech", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    _wav_ok(r.content, 6 * SAMPLES_PER_TOKEN)
    r = httpx.post(url + "/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=30)
    assert len(r.content) == 6 * SAMPLES_PER_TOKEN * 2
    with httpx.stream("POST", url + "/v1/audio/speech", json={**body, "stream_format": "audio"}, timeout=30) as r:
        data = b"".join(r.iter_bytes())
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert len(data) == 44 + 6 * SAMPLES_PER_TOKEN * 2
    r = httpx.post(url + "/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=30)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 6 + ["speech.audio.done"]
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) == 6 * SAMPLES_PER_TOKEN * 2


def test_speech_beyond_the_context_is_a_400(server):
    """Found by the schemathesis fuzz: prompt + max_tokens past the model's positions was a 500."""
    r = httpx.post(server[0] + "/v1/audio/speech", json={"model": MODEL, "input": "0000000111", "max_tokens": 248},
                   timeout=30)
    assert r.status_code == 400 and "exceeds the context" in r.json()["error"]["message"]


def test_speech_errors_and_voices(server, client):
    url = server[0]
    assert get(url, "/v1/audio/voices").json() == {"voices": ["alice", "bob"]}
    r = httpx.post(url + "/v1/audio/speech", json={"model": MODEL, "input": "x", "voice": "zed"}, timeout=30)
    assert r.status_code == 400 and "unknown voice 'zed'" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/audio/speech", json={"model": MODEL, "input": "x", "response_format": "ogg"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    speech = client.audio.speech.create(model=MODEL, input="sdk", voice="alice", response_format="wav")
    _wav_ok(speech.read(), 6 * SAMPLES_PER_TOKEN)


def test_images_generations_and_edits(server, client):
    r = client.images.generate(model=MODEL, prompt="a cat", n=2, size="16x8", response_format="b64_json")
    assert len(r.data) == 2
    img = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json)))
    assert img.size == (16, 8)
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (50, 50, 50)).save(buf, format="PNG")
    r = httpx.post(server[0] + "/v1/images/edits", data={"model": MODEL, "prompt": "edit", "size": "8x8"},
                   files={"image": ("x.png", buf.getvalue(), "image/png")}, timeout=30)
    assert r.status_code == 200, r.text
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (8, 8)
    r = httpx.post(server[0] + "/v1/images/generations", json={"model": MODEL, "prompt": "x", "size": "-4x4"},
                   timeout=30)
    assert r.status_code == 400 and "size" in r.json()["error"]["message"]


def test_generate_ndjson(server):
    from mstar.server.media import tensor_to_json

    ids = tensor_to_json(torch.tensor(encode_text("native"), dtype=torch.int64))
    r = httpx.post(server[0] + "/generate", json={"inputs": {"input_ids": ids}, "params": {"max_tokens": 4}},
                   timeout=30)
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[-1] == {"done": True}
    toks = [int(torch.frombuffer(bytearray(base64.b64decode(x["tensors"][0]["data"])), dtype=torch.int64)[0])
            for x in lines[:-1]]
    assert toks == REF.reference_generate(encode_text("native"), 4)
    r = httpx.post(server[0] + "/generate", json={"inputs": {"input_ids": {"dtype": "int64", "shape": [3],
                                                                           "data": "AAAA"}}}, timeout=30)
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"]


def aborted_count(engine) -> float:
    return engine.metrics.registry.get_sample_value("mstar_aborted_requests_total", {"model": MODEL}) or 0.0


def test_client_disconnect_aborts_and_frees_blocks(server):
    url, engine = server
    aborted = aborted_count(engine)
    # "keep going" meets no EOS in 240 tokens: the request is still running when the client leaves
    body = {"model": MODEL, "messages": [{"role": "user", "content": "keep going"}], "max_tokens": 240,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        assert next(it).startswith("data: ")
    # the connection is closed after one chunk: the request must be aborted and its blocks freed
    wait_for(lambda: engine.runtime.stats()["running_requests"] == 0 and kv_blocks_in_use(engine.runtime) == 0)
    assert aborted_count(engine) == aborted + 1


def test_metrics(server, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=2)
    text = get(server[0], "/metrics").text
    for name in ("mstar_requests_total", "mstar_time_to_first_token_seconds_bucket",
                 "mstar_e2e_request_latency_seconds_count", "mstar_kv_blocks_free", "mstar_node_batches",
                 "mstar_running_requests", "mstar_queue_depth"):
        assert name in text, name
    assert 'route="/v1/chat/completions",status="200"' in text


def test_kv_pressure_over_http_400_for_never_fits_and_metrics():
    from tests.test_kv_pressure import small_cache

    with running_server(ToyChat(), MODEL, placement=small_cache(MODEL, 6)) as (url, engine):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"up to \d+ tokens .*6 blocks \(24 tokens\)"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40)
        prompts = ["one", "second", "the third", "four four", "fifth"]

        async def at_once():  # 5 x (~10 + 10) tokens into a 24-token cache: they take turns
            async with httpx.AsyncClient(timeout=60) as h:
                return await asyncio.gather(*[h.post(url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": p}]}) for p in prompts])

        rs = asyncio.run(at_once())
        assert [r.json()["choices"][0]["message"]["content"] for r in rs] == [expected_text(p, 10) for p in prompts]
        text = get(url, "/metrics").text
        for name in ("mstar_kv_cache_usage", "mstar_kv_waiting_requests", "mstar_kv_swapped_requests",
                     "mstar_kv_preemptions_total"):
            assert f'{name}{{model="{MODEL}",node="LLM",rank="0"}}' in text, name
        wait_for(lambda: kv_blocks_in_use(engine.runtime) == 0)


def test_route_the_model_cannot_serve_names_supported_routes():
    with running_server(ToyLM(), "toy-lm") as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "toy-lm", "messages": [
            {"role": "user", "content": "x"}]}, timeout=30)
        assert r.status_code == 404 and "/generate" in r.json()["error"]["message"]


def test_api_key_and_body_limit():
    with running_server(ToyChat(), MODEL, api_key="sekret") as (url, _):
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert get(url, "/health").status_code == 200  # health stays open for load balancers
        r = httpx.post(url + "/v1/chat/completions", content=b"x" * (33 << 20), timeout=30,
                       headers={"authorization": "Bearer sekret", "content-type": "application/json"})
        assert r.status_code == 413


def test_burst_gets_429_and_memory_stays_bounded():
    async def burst(url):
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "burst"}], "max_tokens": 60}
            rs = await asyncio.gather(*[c.post(url + "/v1/chat/completions", json=body) for _ in range(12)])
            return [r.status_code for r in rs], rs

    with running_server(ToyChat(), MODEL, max_queue=2) as (url, engine):
        codes, rs = asyncio.run(burst(url))
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        assert next(r for r in rs if r.status_code == 429).json()["error"]["type"] == "rate_limit_error"
        wait_for(lambda: kv_blocks_in_use(engine.runtime) == 0)


def test_every_failure_kind_has_one_status():
    from mstar.runtime.failures import FailureKind
    from mstar.server.errors import STATUS_OF_FAILURE

    assert STATUS_OF_FAILURE == {FailureKind.INPUT: 400, FailureKind.WORKER_LOST: 503,
                                 FailureKind.OUT_OF_MEMORY: 503, FailureKind.ABORTED: 503,
                                 FailureKind.INTERNAL: 500}
    assert set(STATUS_OF_FAILURE) == set(FailureKind)  # a new kind must be given a status here


@pytest.mark.slow
def test_lost_worker_gives_503_while_it_restarts_then_serves_again():
    import os
    import signal

    with running_server(ToyChat(), MODEL, workers="process") as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "a"}]
        assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].message.content
        os.kill(engine.runtime.worker_processes[0].pid, signal.SIGKILL)
        wait_for(lambda: get(url, "/health").status_code == 503)
        with pytest.raises(openai.InternalServerError) as e:  # the new process is still starting
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert e.value.status_code == 503
        assert "restarting: worker rank 0 died" in get(url, "/health").json()["error"]["message"]
        wait_for(lambda: get(url, "/health").status_code == 200, timeout=60)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert reply.choices[0].message.content == expected_text("a", 2)


def test_chat_image_output_is_a_data_url_part(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "draw"}], "max_tokens": 2, "image_out": True}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    content = r.json()["choices"][0]["message"]["content"]
    assert content[0] == {"type": "text", "text": expected_text("draw", 2)}
    url = content[1]["image_url"]["url"]
    assert content[1]["type"] == "image_url" and url.startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (4, 2)
