"""Soak and leak audit: a few hundred mixed requests (chat whole and streamed, speech, /generate,
hostile bodies, clients that leave mid-stream, clients that cancel at a random moment), concurrently,
against the toy models inline and in worker processes. Nothing may fail other than the intended 4xx
and 429s, and once the server is idle nothing a request held may be left: KV blocks, walks, stream
buffers, requests in flight, /dev/shm files, file descriptors, threads; RSS grows by a bounded amount.

The bounds (``Slack``) leave room only for pools created on first use and then kept (worker threads
of uvicorn / anyio and torch, sockets of a pool); a warm-up request of every kind runs before the
first sample, so they mostly exist already, and none of the bounds grows with the number of requests.
"""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from mstar.bench.soak_bench import KINDS, Slack, format_report, kinds_for, leaks, serving, soak_in_process
from tests.toy_server_models import ToyChat, encode_text

MODEL = "toy-chat"


def check_clean(report: dict) -> None:
    assert report["errors"] == {}, format_report(report)
    assert report["leaks"] == [], format_report(report)
    assert sum(n for labels in report["labels"].values() for n in labels.values()) == report["requests"]
    for label in report["labels"].get("hostile", {}):
        assert label.isdigit() and 400 <= int(label) < 500 and label != "429", label


def test_soak_inline_toy_chat_every_kind():
    # 16 clients for 12 slots: some requests meet a full server (429), the rest run interleaved
    report = soak_in_process(ToyChat(), MODEL, 300, 16, max_queue=12, seed=1)
    check_clean(report)
    assert set(report["labels"]) == set(KINDS)
    assert report["after"]["counts"]["kv_blocks_used"] == 0 and report["after"]["shm_files"] == []


def test_soak_inline_speech_model():
    report = soak_in_process("orpheus-tiny", "orpheus-tiny", 60, 8, seed=2, max_tokens=12)
    check_clean(report)
    assert set(report["labels"]) <= {"speech", "generate", "hostile", "abort"}
    assert report["labels"]["speech"].get("200")


@pytest.mark.slow
def test_soak_process_mode_no_leak_in_any_process():
    report = soak_in_process(ToyChat(), MODEL, 80, 8, workers="process", seed=3)
    check_clean(report)
    procs = report["after"]["processes"]
    assert set(procs) == {"server", "rank0"}  # the worker process was audited too
    assert report["after"]["counts"]["walks"] == report["after"]["counts"]["stream_buffers"] == 0


def test_kinds_follow_the_models_routes():
    assert kinds_for({"chat", "generate"}) == ["chat", "chat-stream", "generate", "hostile", "disconnect", "abort"]
    assert kinds_for({"speech"}) == ["speech", "hostile"]


def test_leak_report_names_every_kind_of_leak():
    before = {"counts": {"kv_blocks_used": 0, "walks": 0}, "shm_files": ["mstar-old"],
              "processes": {"server": {"fds": 10.0, "threads": 6.0, "rss_mib": 300.0}}}
    after = {"counts": {"kv_blocks_used": 3, "walks": 0}, "shm_files": ["mstar-old", "mstar-new-1"],
             "processes": {"server": {"fds": 19.0, "threads": 7.0, "rss_mib": 301.0},
                           "rank1": {"fds": 99.0, "threads": 9.0, "rss_mib": 1.0}}}  # no before: restarted
    found = leaks(before, after, Slack(fds=8, threads=8, rss_mib=64))
    assert found == ["kv_blocks_used = 3 on an idle server", "1 new shared-memory file(s): mstar-new-1",
                     "server: fds grew by 9 (allowed 8)"]
    assert leaks(before, before, Slack()) == []


def _scope(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


async def _until(cond, what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.01)


async def _leave_while_a_chunk_is_sent(app, engine, path: str, body: dict) -> None:
    """Call the ASGI app as uvicorn does for a client that leaves while its first chunk is being sent:
    that send returns only once the request has produced everything (so the next chunk is ready, its
    generator suspended at a yield), then the client is gone: receive says so, sends are dropped."""
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    received = False

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body") and not gone.is_set():
            await _until(lambda: engine.runtime.stats()["running_requests"] == 0, "the request did not end")
            gone.set()

    await asyncio.wait_for(app(_scope(path, raw), receive, send), 30)
    await _until(lambda: engine.in_flight == 0, "the request still counts as in flight: its stream was never closed")


def aborted_count(engine) -> float:
    return engine.metrics.registry.get_sample_value("mstar_aborted_requests_total", {"model": MODEL}) or 0.0


@pytest.mark.parametrize("path, body", [
    ("/generate", {"inputs": {"input_ids": encode_text("keep going")}, "params": {"max_tokens": 8}}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "keep going"}],
                              "max_tokens": 8, "stream": True}),
    ("/v1/audio/speech", {"model": MODEL, "input": "keep going", "stream_format": "audio",
                          "response_format": "pcm", "max_tokens": 8}),
])
def test_client_gone_during_a_send_is_aborted_without_the_garbage_collector(path, body):
    """Found by the soak: a client gone while a chunk was being sent cancels the send, not the body
    generator, which was left suspended at its yield; its request was aborted and stopped counting
    against --max-queue only when the garbage collector reached it (on an idle server: never). The
    collector is off here: the response must close its body itself."""
    from mstar.server.app import create_app

    with serving(ToyChat(), MODEL) as (_, engine):
        app = create_app(engine)
        aborted = aborted_count(engine)
        gc.collect()
        gc.disable()
        try:
            asyncio.run(_leave_while_a_chunk_is_sent(app, engine, path, body))
        finally:
            gc.enable()
        assert aborted_count(engine) == aborted + 1


def test_bench_soak_command_against_a_url(capsys):
    from mstar.cli.main import main

    with serving(ToyChat(), MODEL) as (url, engine):
        rc = main(["bench", "soak", "--url", url, "--model", MODEL, "--requests", "40", "--concurrency", "4",
                   "--kinds", "chat,chat-stream,hostile,disconnect"])
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "40 requests, concurrency 4" in out and "0 error(s)" in out and "leaks: none" in out
        assert "| kv_blocks_used | 0 | 0 |" in out  # read from the server's /metrics
        assert engine.in_flight == 0
        assert main(["bench", "soak", "--url", url, "--model", MODEL, "--kinds", "chat,nope"]) != 0


def test_bench_soak_command_serves_a_registered_model(capsys, tmp_path):
    from mstar.cli.main import main

    out_file = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--model", "llama-tiny", "--requests", "40", "--concurrency", "4",
               "--out", str(out_file)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out_file.read_text())
    assert report["errors"] == {} and report["leaks"] == [] and "speech" not in report["labels"]
    assert report["after"]["counts"]["walks"] == 0 and "server" in report["after"]["processes"]
