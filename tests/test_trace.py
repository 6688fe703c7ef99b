"""Per-request walk traces (``mstar.runtime.trace``): a request's walks with their node runs (rank,
iteration, batch, queue wait, compute time, postprocess time), found by id or label, for the latest
``trace_requests`` requests; across ranks; over HTTP at ``GET /v1/requests/{id}/trace``."""

from __future__ import annotations

import torch

from mstar import RequestStatus, Runtime
from mstar.models.llama.model import LlamaTiny
from mstar.placement import Placement


def _placement(**runtime) -> Placement:
    return Placement.from_dict({"model": "llama-tiny", "node_groups": [{"node_names": ["LLM"], "ranks": [0]}],
                                "runtime": runtime})


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(1, 250, (6,), generator=torch.Generator().manual_seed(seed))


def test_a_request_trace_has_its_walks_and_their_node_runs():
    with Runtime(LlamaTiny()) as rt:
        out = rt.submit({"input_ids": _prompt(0)}, {"max_tokens": 5, "sampling": {"ignore_eos": True}}, request_id="chat1").result()
        traces = rt.trace("chat1")
        assert rt.trace(out.request_id) == traces  # by its id, or by its label
    assert len(traces) == 1
    t = traces[0]
    assert t["request_id"] == out.request_id and t["status"] == "finished" and t["finish_reason"] == "length"
    assert [w["walk"] for w in t["walks"]] == ["prefill", "decode"]
    assert t["submitted"] <= t["walks"][0]["start"] <= t["walks"][0]["end"] <= t["walks"][1]["start"] <= t["ended"]
    prefill, decode = (w["nodes"] for w in t["walks"])
    assert [r["node"] for r in prefill] == ["LLM"] and prefill[0]["iteration"] == []
    # the prefill samples the first token, the decode loop the other four; its stop flag is read one
    # iteration late (defer_stop_check), so a fifth iteration runs, whose token is dropped
    assert [r["iteration"] for r in decode] == [[0], [1], [2], [3], [4]]
    for run in prefill + decode:
        assert run["rank"] == 0 and run["batch"] == 1 and run["compute_ms"] > 0 and run["queued_ms"] >= 0
    assert all(a["start"] <= b["start"] for a, b in zip(decode, decode[1:]))
    # after each forward its postprocess (routing, sending): the rank runs nothing else meanwhile
    assert all(run["post_ms"] > 0 for run in prefill + decode)
    for a, b in zip(prefill + decode, decode):
        assert b["start"] >= a["start"] + (a["compute_ms"] + a["post_ms"]) / 1e3 - 1e-4  # two clocks, rounding


def test_requests_running_together_show_their_batch():
    with Runtime(LlamaTiny()) as rt:
        handles = [rt.submit({"input_ids": _prompt(i)}, {"max_tokens": 12, "sampling": {"ignore_eos": True}}, request_id="pair")
                   for i in range(2)]
        for h in handles:
            h.result()
        traces = rt.trace("pair")
    assert sorted(t["request_id"] for t in traces) == sorted(h.request_id for h in handles)
    batches = [r["batch"] for t in traces for r in t["walks"][-1]["nodes"]]
    assert max(batches) == 2 and min(batches) >= 1


def test_only_the_latest_requests_are_kept_and_zero_keeps_none():
    with Runtime(LlamaTiny(), _placement(trace_requests=2)) as rt:
        for i in range(3):
            rt.submit({"input_ids": _prompt(i)}, {"max_tokens": 2}, request_id=f"r{i}").result()
        assert rt.trace("r0") == []  # the oldest: dropped
        assert [len(rt.trace(f"r{i}")) for i in (1, 2)] == [1, 1]
        assert rt.trace("nobody") == []
    with Runtime(LlamaTiny(), trace_requests=0) as rt:
        rt.submit({"input_ids": _prompt(0)}, {"max_tokens": 2}, request_id="off").result()
        assert rt.trace("off") == []
        assert all(w.trace is None for w in rt._driver.workers)  # nothing is recorded


def test_a_trace_gathers_every_ranks_runs():
    split = Placement.from_dict({"model": "llama-tiny", "node_groups": [
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]})
    with Runtime(LlamaTiny(), split) as rt:
        rt.submit({"input_ids": _prompt(1)}, {"max_tokens": 4, "sampling": {"ignore_eos": True}}, request_id="pd").result()
        (t,) = rt.trace("pd")
    ranks = {w["walk"]: {r["rank"] for r in w["nodes"]} for w in t["walks"]}
    assert ranks == {"prefill": {0}, "decode": {1}}
    assert t["counts"]["sent@0"]["bytes_to_rank_1"] > 0  # the prompt's KV, moved to the decode rank


def test_a_running_request_has_a_trace_too():
    with Runtime(LlamaTiny()) as rt:
        h = rt.submit({"input_ids": _prompt(2)}, {"max_tokens": 400, "sampling": {"ignore_eos": True}}, request_id="live")
        next(iter(h))  # its first token is out: it is running
        (t,) = rt.trace("live")
        assert t["status"] == "running" and t["ended"] is None and t["walks"]
        rt.abort(h.request_id)
        assert h.result().status == RequestStatus.ABORTED
        (t,) = rt.trace("live")
    assert t["status"] == "aborted" and t["finish_reason"] == "abort"


def test_the_server_gives_a_requests_trace_by_its_x_request_id():
    import httpx

    from tests.server_utils import running_server

    with running_server(LlamaTiny(), "llama-tiny") as (url, _):
        body = {"model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": "chat-42"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "chat-42"
        trace = httpx.get(url + "/v1/requests/chat-42/trace", timeout=30)
        missing = httpx.get(url + "/v1/requests/no-such-request/trace", timeout=30)
    assert trace.status_code == 200
    doc = trace.json()
    assert doc["object"] == "request.trace" and doc["id"] == "chat-42"
    assert len(doc["requests"]) == 2  # one runtime request per choice
    for t in doc["requests"]:
        assert t["status"] == "finished" and t["walks"][0]["walk"] == "prefill" and t["walks"][0]["nodes"]
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "trace_not_found"


def test_a_trace_counts_prefix_hits_kv_blocks_and_preemptions():
    from tests.test_kv_pressure import kv_totals, lm_requests, small_cache
    from tests.toy_models import ToyLM

    prompt = torch.arange(1, 14)  # 13 tokens: 3 full blocks of 4 to reuse
    with Runtime(LlamaTiny(), _placement(kv_block_size=4)) as rt:
        for label in ("first", "again"):
            rt.submit({"input_ids": prompt}, {"max_tokens": 3}, request_id=label).result()
        (first,), (again,) = rt.trace("first"), rt.trace("again")
    assert "prefix_hit_tokens" not in first["counts"]["LLM@0"] and again["counts"]["LLM@0"]["prefix_hit_tokens"] == 12
    # 13 prompt + 3 generated (+ the deferred stop check's one) tokens in blocks of 4
    assert first["counts"]["LLM@0"]["kv_blocks_at_end"] == again["counts"]["LLM@0"]["kv_blocks_at_end"] >= 4
    # 4x more than the cache holds: the preemptions each trace counts are the rank's
    with Runtime(ToyLM(defer_stop_check=True), small_cache("toy-lm", 10)) as rt:
        handles = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": m}, request_id="load")
                   for p, m in lm_requests(24, seed=1)]
        for h in handles:
            h.result(timeout=60)
        traced = sum(t["counts"].get("LLM@0", {}).get("preemptions", 0) for t in rt.trace("load"))
        assert traced == kv_totals(rt)["preemptions"] > 0


def test_a_streaming_requests_trace_has_its_stream_and_chunks():
    from mstar.model.registry import resolve_model
    from mstar.models.orpheus.config import END_OF_PROMPT, START_OF_HUMAN

    with Runtime(resolve_model("orpheus-tiny")) as rt:
        prompt = torch.tensor([START_OF_HUMAN, 5, 9, 13, *END_OF_PROMPT])
        rt.submit({"input_ids": prompt}, {"max_tokens": 40, "sampling": {"seed": 1}}, request_id="tts").result()
        (t,) = rt.trace("tts")
    assert t["streamed"] and all(n > 0 for n in t["streamed"].values())
    codec = [r for w in t["walks"] if w["partition"] != t["walks"][0]["partition"] for r in w["nodes"]]
    assert codec and all("chunks" in r for r in codec)  # each codec run names the stream chunk it took


def test_an_untraced_request_takes_no_traced_ones_place():
    """``submit(trace=False)`` (the realtime route's VAD and prefill requests): nothing is kept of it,
    on the conductor or the workers, so the latest traced requests stay findable."""
    with Runtime(LlamaTiny(), _placement(trace_requests=2)) as rt:
        rt.submit({"input_ids": _prompt(0)}, {"max_tokens": 2}, request_id="kept").result()
        for i in range(5):
            rt.submit({"input_ids": _prompt(i + 1)}, {"max_tokens": 2}, request_id="own", trace=False).result()
        assert rt.trace("own") == []
        (t,) = rt.trace("kept")
        assert t["walks"][0]["nodes"]  # its runs still on the worker
        assert all(not any(rid.startswith("own-") for rid in w.trace._runs) for w in rt._driver.workers)
