"""`mstar bench serve` counts tokens, audio and latencies correctly against a scripted server with
known pacing, writes JSON and a PNG plot, and reports errors."""

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from mstar.bench.serve_bench import format_table, run_serve_bench, write_plot
from tests.server_utils import running_app, running_server

TOKENS, GAP, AUDIO_CHUNKS, CHUNK_BYTES = 5, 0.03, 3, 4800  # 4800 bytes = 0.1 s of 24 kHz PCM16


def scripted_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        async def sse():
            yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
            for i in range(TOKENS):
                await asyncio.sleep(GAP)
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": TOKENS}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/audio/speech")
    async def speech(body: dict):
        async def pcm():
            for _ in range(AUDIO_CHUNKS):
                await asyncio.sleep(GAP)
                yield b"\x00" * CHUNK_BYTES
        return StreamingResponse(pcm(), media_type="audio/pcm")

    @app.post("/generate")
    async def generate(body: dict):
        return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)

    return app


@pytest.fixture(scope="module")
def scripted():
    with running_app(scripted_app()) as url:
        yield url


def test_chat_counts_tokens_and_latencies(scripted, tmp_path):
    report = run_serve_bench(scripted, "chat", "m", concurrency=[1, 2], num_requests=4, show_progress=False)
    for r in report["results"]:
        assert r["errors"] == 0 and r["requests"] == 4 and r["tokens"] == 4 * TOKENS
        assert r["ttft_p50"] >= GAP * 0.9  # the first token comes after one gap
        assert r["itl_p50"] >= GAP * 0.9 and r["e2e_p50"] >= TOKENS * GAP * 0.9
        assert r["ttft_p50"] <= r["e2e_p50"]
    assert "| concurrency 2 |" in format_table(report)
    path = tmp_path / "r.png"
    write_plot(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.loads(json.dumps(report))  # JSON-serialisable as written by --out


def test_speech_counts_audio_seconds(scripted):
    report = run_serve_bench(scripted, "speech", "m", concurrency=[2], num_requests=4, show_progress=False)
    (r,) = report["results"]
    assert r["errors"] == 0 and r["audio_s"] == pytest.approx(4 * AUDIO_CHUNKS * CHUNK_BYTES / 2 / 24000)
    assert r["rtf_p50"] > 0 and "audio-s/s" in format_table(report)


def test_errors_are_counted(scripted):
    report = run_serve_bench(scripted, "generate", "m", concurrency=[1], num_requests=2, show_progress=False)
    (r,) = report["results"]
    assert r["errors"] == 2 and "HTTP 500" in r["first_error"]


def test_open_loop_against_the_real_server():
    from tests.toy_server_models import ToyChat

    with running_server(ToyChat(), "toy-chat") as (url, _):
        report = run_serve_bench(url, "chat", "toy-chat", request_rate=50.0, num_requests=6, max_tokens=4,
                                 show_progress=False)
        (r,) = report["results"]
        assert r["errors"] == 0 and r["tokens"] == 6 * 4 and r["request_rate"] == 50.0
