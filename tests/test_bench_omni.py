"""``mstar bench compare omni`` at test size: the qwen3-omni-tiny config saved by transformers and loaded by
mstar, a few frames per request. The table has a row per system and concurrency and a line per goal;
with greedy decoding mstar and both transformers baselines speak the same frames (codes and audio
length), and mstar's first audio comes before its end."""

from __future__ import annotations

import pytest
import torch

from mstar.bench import omni_bench
from mstar.models.qwen3_omni.config import TINY_HF_CONFIG

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def result():
    import os

    old = os.environ.get("MSTAR_KERNELS")
    os.environ["MSTAR_KERNELS"] = "torch"  # the compiled kernel's first build would dominate
    try:
        torch.manual_seed(0)
        messages: list[str] = []
        res = omni_bench.run_omni_bench([1, 2], text_tokens=4, talker_steps=5, repeats=1,
                                        config=dict(TINY_HF_CONFIG), profile=True, log=messages.append)
        res.messages = messages
        yield res
    finally:
        if old is None:
            os.environ.pop("MSTAR_KERNELS", None)
        else:
            os.environ["MSTAR_KERNELS"] = old


def test_greedy_runs_give_the_same_codes_and_audio_length(result):
    assert [r.concurrency for r in result.results] == [1, 2]
    for r in result.results:
        p = r.parity
        assert p is not None and p.requests == r.concurrency
        assert p.ok, p
        for s in r.systems.values():
            assert s.audio_s_per_request == pytest.approx((1920 * 4 - 555) / 24000)


def test_levels_are_timed_in_turn_each_run_after_its_own_warm_up(result):
    # each repeat runs every (level, system) pair (host drift reaches all; the first repeat in the
    # harness's unrotated order); every timed run follows an untimed one of the same system and level
    # (not the state another system's run left)
    runs = [m.split(":")[0] for m in result.messages if m.startswith("concurrency")]
    assert runs == [f"concurrency {c} {tail}" for c in (1, 2) for s in omni_bench.SYSTEMS
                    for tail in (f"{s} warm-up", f"repeat 1/1 {s}")]


def test_summaries_are_consistent(result):
    for r in result.results:
        assert set(r.systems) == set(omni_bench.SYSTEMS)
        mine = r.systems["mstar"]
        assert 0 < mine.ttfa_p50_ms <= mine.ttfa_p95_ms
        batched = r.systems["hf-batched"]
        assert batched.ttfa_p50_ms == batched.ttfa_p95_ms  # one generate: every request ends together
        for s in r.systems.values():
            med, lo, hi = s.req_per_s
            assert 0 < lo <= med <= hi
            assert s.rtf_p50 > 0
        best = max(r.systems[b].req_per_s[0] for b in omni_bench.BASELINES)
        assert r.throughput_ratio == pytest.approx(mine.req_per_s[0] / best)


def test_table_has_every_row_and_goal(result):
    table = omni_bench.format_table(result)
    assert "the qwen3-omni-tiny config" in table and f"torch threads {result.threads}" in table
    for c in (1, 2):
        for system in omni_bench.SYSTEMS:
            assert f"| {c} | {system} |" in table
    goals = omni_bench.goals(result)
    assert len(goals) == 4  # throughput at 2, TTFA at 1 and 2, TTFA p95 at 2 vs 1
    for text, ok in goals:
        assert f"goal {'met' if ok else 'NOT met'}: {text}" in table
    assert ("mstar profile at concurrency 2" in table) == (not all(ok for _, ok in goals))
    hit, looked = result.prefix_tokens  # every prompt starts with the shared system turn (each level: warm-up + repeat)
    assert 0 < hit < looked and looked == 2 * sum(len(p) for c in (1, 2) for p in omni_bench.prompts(c))
    rows_hit, rows = result.talker_prefix_rows  # the user turn and 8 assistant rows; repeated prompts reuse theirs
    assert 0 < rows_hit < rows
    assert f"the Thinker reused {hit} of {looked} prompt tokens" in table and f"the Talker {rows_hit} of {rows}" in table
    data = omni_bench.to_json(result)
    assert [g["met"] for g in data["goals"]] == [ok for _, ok in goals]


def test_prompts_are_chat_turns_ending_in_the_assistant_header():
    from mstar.models.qwen3_omni.prompt import OmniTokenIds

    ids = OmniTokenIds()
    batch = omni_bench.prompts(3)
    assert len({tuple(p) for p in batch}) == 3
    for p in batch:
        assert p[:2] == [ids.im_start, ids.system] and p[-3:] == [ids.im_start, ids.assistant, ids.newline]
        assert p.count(ids.user) == 1


def test_bench_config_is_larger_and_consistent():
    cfg = omni_bench.bench_hf_config(hidden=128, layers=4, experts=8)
    text = cfg["thinker_config"]["text_config"]
    talker = cfg["talker_config"]
    assert text["hidden_size"] == talker["text_config"]["hidden_size"] == 128
    assert talker["code_predictor_config"]["hidden_size"] == talker["thinker_hidden_size"] == 128
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert "larger than qwen3-omni-tiny" in omni_bench.describe_config(cfg)
    assert TINY_HF_CONFIG["thinker_config"]["text_config"]["hidden_size"] == 64  # the shared config is untouched


def test_cli_parses_the_omni_suite():
    import argparse

    from mstar.cli import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["bench", "compare", "omni", "--levels", "1,4", "--talker-steps", "9", "--sample"])
    assert args.suite == "omni" and args.levels == [1, 4] and args.talker_steps == 9 and args.sample
    assert args.prefix_caching
    assert not parser.parse_args(["bench", "compare", "omni", "--no-prefix-caching"]).prefix_caching
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "compare", "omni", "--levels", "0"])
    args = parser.parse_args(["bench", "compare", "omni", "--hidden", "48"])
    with pytest.raises(ValueError, match="multiple of 32"):
        bench_cmd.run_compare(args)


def test_sampled_talker_has_no_parity_line(monkeypatch):
    """``--sample``: the reference's talker sampling on every system; lengths still match (EOS
    suppressed), codes are not compared."""
    monkeypatch.setenv("MSTAR_KERNELS", "torch")
    res = omni_bench.run_omni_bench([1], text_tokens=3, talker_steps=4, repeats=1, sample=True,
                                    config=dict(TINY_HF_CONFIG), profile=False, prefix_caching=False)
    (r,) = res.results
    assert r.parity is None and res.sampled and not res.profile
    assert res.prefix_tokens == res.talker_prefix_rows == (0, 0)
    assert "mstar prefix cache: off" in omni_bench.format_table(res)
    assert all(s.audio_s_per_request == pytest.approx((1920 * 3 - 555) / 24000) for s in r.systems.values())
    table = omni_bench.format_table(res)
    assert "talker sampled (temperature 0.9, top-k 50)" in table and "parity" not in table


def test_hf_weights_do_not_depend_on_what_memory_held():
    """transformers leaves the talker's fused expert tensors uninitialised; the benchmark fills them
    from its seed, so two builds are equal and finite whatever the allocator hands out."""
    junk = [torch.full((1 << 20,), float("nan")) for _ in range(64)]
    del junk
    first = omni_bench.build_hf(dict(TINY_HF_CONFIG), 0).state_dict()
    junk = [torch.full((1 << 20,), 1e30) for _ in range(64)]
    del junk
    second = omni_bench.build_hf(dict(TINY_HF_CONFIG), 0).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) and torch.isfinite(first[k]).all() for k in first)


def test_audio_clock_times_the_first_non_empty_chunk():
    import time

    from mstar.bench.stats import AudioClock

    clock = AudioClock(time.perf_counter())
    clock.add([torch.zeros(0)])  # an empty item is not audio
    assert clock.first is None and clock.samples == 0
    clock.add([torch.zeros(3), torch.zeros(2)])
    first = clock.first
    clock.add([torch.zeros(4)])
    ttfa, end = clock.times()
    assert clock.first == first and clock.samples == 9 and 0 <= ttfa <= end
    silent = AudioClock(time.perf_counter())
    ttfa, end = silent.times()
    assert ttfa == end  # no audio: first audio = the end
