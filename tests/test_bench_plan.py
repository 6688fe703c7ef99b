"""``mstar bench plan``'s tables and goals (the runs themselves are the suite's, not CI's), and
``mstar plan`` profiling a model end to end."""

from __future__ import annotations

import argparse

import pytest
import yaml

from mstar.bench.plan_bench import CASES, Check, PlanBench, Repeat, Side, format_tables, goals, run
from mstar.cli.main import main
from mstar.planner.profile import Profile


def _bench(errors: list[float], ratios: list[float]) -> PlanBench:
    checks = [Check("m", "light (1/s)", "split", "e2e", (0.1 * (1 + e), 0.2), (0.1, 0.2)) for e in errors]
    sides = [Side(f"m{i}", "e2e_p95<=1s", "a", "b", (r, 1.0), (r, 1.0)) for i, r in enumerate(ratios)]
    return PlanBench(checks, sides)


def test_goals_judge_every_judged_check_and_two_models_goodput():
    (within, ok_within), (goodput, ok_goodput) = goals(_bench([0.1, -0.2], [1.5, 1.4, 1.0]))
    assert ok_within and "2 of 2 checks" in within and ok_goodput
    (within, ok_within), (_, ok_goodput) = goals(_bench([0.1, 0.3], [1.5, 1.0, 1.0]))
    assert not ok_within and "1 of 2 checks" in within and not ok_goodput
    res = _bench([0.5], [0.0])
    res.checks[0].judged = False  # shown, not judged
    res.sides[0].goodput = (2.0, 0.0)
    (within, ok_within), (goodput, ok_goodput) = goals(res)
    assert ok_within and "0 of 0" in within and "naive: no request within the SLO" in goodput
    validation, sides = format_tables(res)
    assert "split (not judged)" in validation and "50%" in validation
    assert "naive: no request within the SLO" in sides
    # the same replay (prediction) twice: the third table shows how far the host's own figures differ
    res.repeats = [Repeat("m", "light (1/s)", "split", "e2e", "replayed again", (0.1, 0.2), (0.125, 0.2))]
    *_, noise = format_tables(res)
    assert "| replayed again | 100.0 | 125.0 | 25% | 200.0 | 200.0 | 0% |" in noise
    assert goals(res)[0][1]  # not a check of the planner


def test_the_cases_are_the_issues_placements_and_unknown_models_are_refused():
    assert [c.model for c in CASES] == ["llama-tiny", "orpheus-tiny", "bagel-tiny"]
    assert any(g.get("graph_walks") == ["decode"] for g in CASES[0].split)
    with pytest.raises(ValueError, match="unknown model"):
        run(argparse.Namespace(models="nope", duration=1.0))


def test_mstar_plan_profiles_the_model_and_writes_its_profile(tmp_path, capsys):
    (tmp_path / "w.yaml").write_text(yaml.safe_dump({"arrival_rate": 20, "duration_s": 0.5, "requests": [
        {"name": "chat", "prompt_tokens": {"uniform": [4, 12]}, "output_tokens": 3}]}))
    code = main(["plan", "llama-tiny", "--ranks", "1", "--workers", "inline", "--max-batch", "4", "--workload",
                 str(tmp_path / "w.yaml"), "--slo", "e2e_p95<=10s", "--profile", str(tmp_path / "p.json")])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("plan: rank 0: LLM (1 of 1 ranks)")
    assert "profiling llama-tiny" in captured.err
    prof = Profile.load(tmp_path / "p.json")
    assert prof.model == "llama-tiny" and set(prof.programs) == {"chat"} and prof.max_batch == 4
