"""Tensor parallelism through the ``Runtime``: the LLM at TP2 over two gloo worker processes gives
what one rank gives (greedy and seeded tokens, audio), KV blocks return to zero on every rank, and
a dead TP rank fails its group's requests as a lost worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from mstar.placement import Placement, PlacementError
from mstar.runtime import Runtime
from mstar.runtime.conductor import RequestStatus
from mstar.runtime.failures import FailureKind
from mstar.server.errors import STATUS_OF_FAILURE

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 84, 80, 50, 32, 105, 115, 32, 102, 117, 110], [1, 33]]
GREEDY = {"max_tokens": 40}
SEEDED = {"max_tokens": 40, "sampling": {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 11}}
# 6 blocks of 16 tokens: three requests of up to 51 tokens (10 blocks together) cannot all fit, so the
# leader swaps requests out and in, and its followers must repeat it
SMALL_CACHE = {"kv_cache_blocks": 6, "kv_block_size": 16}


def _inputs(prompts):
    return [{"input_ids": torch.tensor(p)} for p in prompts]


def _tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.finished, o.error
    return [[int(t) for t in o.tensors("token")] for o in outs]


def _wait_until(condition, timeout: float = 30.0) -> None:
    """Poll a condition another thread makes true (bounded; the check itself is the assertion)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        threading.Event().wait(0.02)


def _blocks_used_per_rank(rt) -> list[int]:
    return [sum(kv["blocks_used"] for kv in r["kv"].values()) for r in rt.stats()["ranks"]]


@pytest.fixture(scope="module", autouse=True)
def _torch_attention():
    """The PyTorch paths in every worker: these tests are about the shards, and the
    compiled kernel's first build in a fresh cache would dominate their time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSTAR_KERNELS", "torch")
        yield


@pytest.fixture(scope="module")
def reference():
    with Runtime("llama-tiny") as rt:
        return {"greedy": _tokens(rt.generate(_inputs(PROMPTS), GREEDY)),
                "seeded": _tokens(rt.generate(_inputs(PROMPTS), SEEDED))}


@pytest.fixture(scope="module")
def llama_tp2():
    placement = Placement.load(ROOT / "examples" / "placements" / "llama_tp2.yaml")
    placement = Placement.from_dict({**placement.to_dict(), "runtime": SMALL_CACHE})
    rt = Runtime("llama-tiny", placement, workers="process", on_worker_death="restart").start()
    yield rt
    rt.shutdown()


def test_tp2_greedy_tokens_equal_one_rank(llama_tp2, reference):
    assert _tokens(llama_tp2.generate(_inputs(PROMPTS), GREEDY)) == reference["greedy"]


def test_tp2_seeded_samples_equal_one_rank(llama_tp2, reference):
    assert _tokens(llama_tp2.generate(_inputs(PROMPTS), SEEDED)) == reference["seeded"]


def test_tp2_leader_schedules_and_kv_blocks_return_to_zero_on_every_rank(llama_tp2):
    ranks = llama_tp2.stats()["ranks"]
    assert [r["tensor_parallel"]["LLM"] for r in ranks] == [{"ranks": [0, 1], "role": "leader"},
                                                           {"ranks": [0, 1], "role": "follower"}]
    assert ranks[0]["batch_sizes"]["LLM"] and not ranks[1]["batch_sizes"]["LLM"]  # the follower queues nothing
    assert ranks[0]["preemptions"]["LLM"] > 0  # the small cache made the leader swap (mirrored on rank 1)
    assert ranks[1]["kv"]["LLM"]["preemptions"] == ranks[0]["kv"]["LLM"]["preemptions"]
    assert _blocks_used_per_rank(llama_tp2) == [0, 0]


def test_tp2_prefix_caching_reuses_the_same_blocks_on_every_rank(llama_tp2):
    """Prompts sharing two full blocks: the follower, replaying the leader's calls, reuses exactly
    what the leader reuses, and the tokens are one rank's."""
    shared = list(range(40, 72))
    prompts = [shared + [5, 6], shared + [7]]
    with Runtime("llama-tiny") as rt:
        alone = [_tokens(rt.generate(_inputs([p]), {"max_tokens": 8})) for p in prompts]
    before = [r["kv"]["LLM"]["prefix_hit_tokens"] for r in llama_tp2.stats()["ranks"]]
    got = [_tokens(llama_tp2.generate(_inputs([p]), {"max_tokens": 8})) for p in prompts]
    after = [r["kv"]["LLM"]["prefix_hit_tokens"] for r in llama_tp2.stats()["ranks"]]
    assert got == alone
    assert after[0] - before[0] >= 32 and after[0] - before[0] == after[1] - before[1]
    assert _blocks_used_per_rank(llama_tp2) == [0, 0]


def test_tp2_abort_frees_every_rank(llama_tp2):
    h = llama_tp2.submit({"input_ids": torch.tensor(PROMPTS[0])}, {"max_tokens": 80})
    next(iter(h))
    llama_tp2.abort(h.request_id)
    assert h.result(timeout=60).status is RequestStatus.ABORTED
    assert _blocks_used_per_rank(llama_tp2) == [0, 0]


def test_dead_tp_rank_fails_the_groups_requests_as_worker_lost(llama_tp2):
    """Last in the module: it ends the shared runtime."""
    rt = llama_tp2
    h = rt.submit({"input_ids": torch.tensor(PROMPTS[0])}, {"max_tokens": 80})
    next(iter(h))
    os.kill(rt.worker_processes[1].pid, signal.SIGKILL)  # the follower
    out = h.result(timeout=60)
    # whichever notices first: the leader's collective (the peer closed its sockets) or the driver
    assert out.status is RequestStatus.FAILED and out.failure is FailureKind.WORKER_LOST, out.error
    assert STATUS_OF_FAILURE[out.failure] == 503
    rt.worker_processes[1].join(30)
    _wait_until(lambda: rt.fatal is not None)  # the driver looks at its processes every 0.25 s
    assert not rt.healthy and "worker rank 1 died" in rt.fatal and "cannot rejoin" in rt.fatal  # not restarted
    with pytest.raises(RuntimeError, match="unhealthy"):
        rt.submit({"input_ids": torch.tensor([1])})


def test_orpheus_tp2_gives_the_audio_of_one_rank():
    prompts = _inputs(PROMPTS[:2])
    params = {"max_tokens": 42, "sampling": {"seed": 5}}  # Orpheus samples by default
    with Runtime("orpheus-tiny") as rt:
        one = rt.generate(prompts, params)
    placement = Placement.load(ROOT / "examples" / "placements" / "orpheus_tp2_codec_rank.yaml")
    assert placement.ranks_of("snac_decoder", "decode") == (2,)  # the example: the codec on rank 2
    groups = [g.to_dict() for g in placement.node_groups]
    groups[1]["ranks"] = [1]  # here on the follower, to stay at two processes: it runs both
    placement = Placement.from_dict({**placement.to_dict(), "node_groups": groups})
    with Runtime("orpheus-tiny", placement, workers="process") as rt:
        two = rt.generate(prompts, params)
        ranks = rt.stats()["ranks"]
        assert ranks[1]["batch_sizes"]["snac_decoder"] and ranks[1]["tensor_parallel"]["LLM"]["role"] == "follower"
        assert _blocks_used_per_rank(rt) == [0, 0]
    assert _tokens(two) == _tokens(one)
    for a, b in zip(one, two):
        a_pcm, b_pcm = torch.cat(a.tensors("audio")), torch.cat(b.tensors("audio"))
        assert a_pcm.shape == b_pcm.shape and a_pcm.numel() > 0
        assert int((a_pcm.int() - b_pcm.int()).abs().max()) <= 1  # windows may batch differently: float noise


def test_tp_placements_the_runtime_cannot_run_are_refused_before_any_worker_starts():
    tp2 = {"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2}
    for kwargs in ({}, {"workers": "ray"}, {"workers": "process", "transport": "tcp"}):
        with pytest.raises(ValueError, match="runs on worker processes of one host"):
            Runtime("llama-tiny", Placement.from_dict({"node_groups": [tp2]}), **kwargs)
    resharded = {"node_groups": [{**tp2, "graph_walks": ["prefill"]},
                                 {"node_names": ["LLM"], "ranks": [2], "graph_walks": ["decode"]}]}
    with pytest.raises(PlacementError, match="resharding is not supported"):
        Runtime("llama-tiny", Placement.from_dict(resharded), workers="process")
    overlapping = {"node_groups": [{**tp2, "graph_walks": ["prefill"]},
                                   {**tp2, "ranks": [1, 2], "graph_walks": ["decode"]}]}
    with pytest.raises(PlacementError, match="rank 1 is in two tensor-parallel groups"):
        Runtime("llama-tiny", Placement.from_dict(overlapping), workers="process")


@pytest.mark.slow
def test_prefill_on_one_tp2_group_decode_on_another_moves_each_shard(reference):
    """Four worker processes (the one test here with more than two): KV shards move 0 -> 2, 1 -> 3."""
    placement = Placement.load(ROOT / "examples" / "placements" / "llama_tp2_pd_split.yaml")
    with Runtime("llama-tiny", placement, workers="process") as rt:
        assert _tokens(rt.generate(_inputs(PROMPTS), GREEDY)) == reference["greedy"]
        ranks = rt.stats()["ranks"]
        assert [bool(r["batch_sizes"]["LLM"]) for r in ranks] == [True, False, True, False]  # the leaders
        assert _blocks_used_per_rank(rt) == [0, 0, 0, 0]
