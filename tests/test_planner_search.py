"""The planner's search and ``mstar plan``: candidates, the cheapest placement meeting the SLO, an
impossible SLO (said, with the best achievable), and the command line's errors."""

from __future__ import annotations

import pytest
import yaml

from mstar.cli.main import main
from mstar.models.llama.model import LlamaTiny
from mstar.placement import Placement
from mstar.planner import parse_slo, parse_workload
from mstar.planner.search import candidates, describe, goodput, plan
from mstar.planner.simulate import Prediction, RequestTimes
from tests.test_planner_model import _profile

WORKLOAD = {"arrival_rate": 20, "duration_s": 2, "requests": [
    {"name": "chat", "prompt_tokens": {"uniform": [10, 20]}, "output_tokens": {"uniform": [3, 5]}}]}


def test_candidates_cover_one_rank_a_walk_split_and_tensor_parallelism():
    model = LlamaTiny()
    found = {c.name: c for c in candidates(model, _profile(tp_sizes=(1, 2)), 2, ["LLM"])}
    assert set(found) == {"rank 0: LLM", "rank 0: LLM (prefill); rank 1: LLM (decode)", "ranks 0-1 (TP2): LLM"}
    assert [c.ranks_used for c in found.values()] == [1, 2, 2]
    for c in found.values():  # every candidate is a valid placement of the model
        Placement.from_dict(c.placement_dict(model.name, 16)).validate(model.graph)
    assert "TP2" not in " ".join(c.name for c in candidates(model, _profile(), 2, ["LLM"]))
    assert [c.name for c in candidates(model, _profile(), 1, ["LLM"])] == ["rank 0: LLM"]
    assert describe([{"node_names": ["a", "b"], "ranks": [1]}]) == "rank 1: a, b"


def test_the_cheapest_placement_meeting_the_slo_is_chosen():
    model, wl = LlamaTiny(), parse_workload(WORKLOAD)
    loose = plan(model, _profile(tp_sizes=(1, 2)), wl, parse_slo("ttft_p95<=1s,tpot_p95<=1s"), 2)
    assert loose.feasible and loose.chosen.candidate.ranks_used == 1 and len(loose.evaluated) == 3
    # costlier prompts (0.6 ms a token) hold up the decode steps behind them on one rank: only the
    # split, whose decode rank runs no prompt, meets the TPOT limit
    slow = _profile(contention={"shared": {1: 1.0, 2: 1.0}, "split": {1: 1.0, 2: 1.0}})
    slow.costs["LLM@tp1/t2"] = type(slow.costs["LLM@tp1/t2"])(1.0, 0.5, 0.6, 0.0)
    tight = plan(model, slow, wl, parse_slo("tpot_p95<=8ms"), 2)
    assert tight.feasible and "(decode)" in tight.chosen.candidate.name
    assert all(e.met or e.shortfall > 1 for e in tight.evaluated)


def test_an_impossible_slo_says_so_and_gives_the_best_achievable(tmp_path, capsys):
    model, wl = LlamaTiny(), parse_workload(WORKLOAD)
    result = plan(model, _profile(), wl, parse_slo("ttft_p95<=1ms"), 2)
    assert not result.feasible and result.chosen.shortfall > 1
    assert result.chosen.shortfall == min(e.shortfall for e in result.evaluated if e.goodput == result.chosen.goodput)
    prof = tmp_path / "p.json"
    _profile().save(prof)
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(WORKLOAD))
    code = main(["plan", "llama-tiny", "--ranks", "2", "--workload", str(tmp_path / "w.yaml"), "--slo",
                 "ttft_p95<=1ms", "--from-profile", str(prof), "--out", str(tmp_path / "plan.yaml")])
    out = capsys.readouterr().out
    assert code == 1 and "no placement over 2 ranks meets ttft_p95<=1ms" in out and "best predicted" in out
    written = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    Placement.from_dict(written).validate(model.graph)
    assert "NOT met" in (tmp_path / "plan.yaml").read_text()
    code = main(["plan", "llama-tiny", "--ranks", "2", "--workload", str(tmp_path / "w.yaml"), "--slo",
                 "ttft_p95<=1s", "--from-profile", str(prof)])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("plan: rank 0: LLM (1 of 2 ranks)") and "node_groups:" in out


def test_bad_input_to_mstar_plan_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "w.yaml").write_text(yaml.safe_dump({**WORKLOAD, "requests": [{"name": "x", "prompt_tokens": -1, "output_tokens": 2}]}))
    prof = tmp_path / "p.json"
    _profile().save(prof)
    args = ["plan", "llama-tiny", "--ranks", "2", "--from-profile", str(prof)]
    assert main([*args, "--workload", str(tmp_path / "w.yaml"), "--slo", "ttft_p95<=1s"]) == 2
    assert "requests[0].prompt_tokens" in capsys.readouterr().err
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(WORKLOAD))
    assert main([*args, "--workload", str(tmp_path / "ok.yaml"), "--slo", "latency<=1"]) == 2
    assert "cannot read objective" in capsys.readouterr().err
    assert main(["plan", "llama-tiny", "--ranks", "2", "--from-profile", str(tmp_path / "none.json"),
                 "--workload", str(tmp_path / "ok.yaml"), "--slo", "ttft_p95<=1s"]) == 2
    assert "not a planner profile" in capsys.readouterr().err
    other = {**WORKLOAD, "requests": [{"name": "other", "prompt_tokens": 4, "output_tokens": 2}]}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert main([*args, "--workload", str(tmp_path / "other.yaml"), "--slo", "ttft_p95<=1s"]) == 2
    assert "no program of request class 'other'" in capsys.readouterr().err


def test_a_model_that_makes_no_sized_requests_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from mstar.model.base import ModelDef
    from mstar.models.llama.model import LlamaTiny

    monkeypatch.setattr(LlamaTiny, "sized_request", ModelDef.sized_request)  # as a family without one
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(WORKLOAD))
    assert main(["plan", "llama-tiny", "--ranks", "2", "--workload", str(tmp_path / "ok.yaml"),
                 "--slo", "ttft_p95<=1s"]) == 2
    err = capsys.readouterr().err
    assert "llama-tiny makes no sized requests" in err and "Traceback" not in err


def test_goodput_counts_requests_within_every_limit_per_second():
    reqs = [RequestTimes("c", 0.0, 0.1, 0.5, 0.01), RequestTimes("c", 0.1, 0.3, 0.6, 0.01),
            RequestTimes("c", 0.2, 0.1, 0.3, None)]
    pred = Prediction(reqs, 4.0)
    slo = parse_slo("ttft_p50<=200ms,tpot_p99<=20ms")
    assert goodput(pred, slo, 2.0) == pytest.approx(2 / 4.0)  # the second misses TTFT; over the 4 s makespan
    assert goodput(Prediction(reqs, 1.0), slo, 2.0) == pytest.approx(2 / 2.0)


def test_ranks_may_split_the_cores_and_then_do_not_slow_each_other():
    model = LlamaTiny()
    prof = _profile(threads=(1, 2))
    prof.costs["LLM@tp1/t1"] = type(prof.costs["LLM@tp1/t2"])(1.5, 0.6, 0.15, 0.0)
    names = [c.name for c in candidates(model, prof, 2, ["LLM"])]
    assert "rank 0 [1 thread]: LLM (prefill); rank 1 [1 thread]: LLM (decode)" in names
    assert not any("thread" in n for n in names if n.startswith("rank 0: LLM") and "rank 1" not in n)
    # two ranks on 1 thread each fit the 2 cores (the split table); on 2 each they share them
    assert prof.slowdown([1, 1]) == 1.0 and prof.slowdown([2, 2]) == 2.0 and prof.slowdown([2, 2, 2]) == 3.0
    assert prof.slowdown([2]) == 1.0
    split = [c for c in candidates(model, prof, 2, ["LLM"]) if "[1 thread]" in c.name][0]
    placement = Placement.from_dict(split.placement_dict(model.name, 16)).validate(model.graph)
    assert [placement.threads_of(r) for r in (0, 1)] == [1, 1]


def test_the_example_workloads_parse():
    from pathlib import Path

    from mstar.planner import load_workload

    root = Path(__file__).resolve().parents[1] / "examples" / "workloads"
    loaded = {p.stem: load_workload(p) for p in sorted(root.glob("*.yaml"))}
    assert set(loaded) == {"chat", "speech", "t2i"} and all(w.arrivals() for w in loaded.values())
    assert loaded["t2i"].requests[0].params["target"] == "image"
