"""The repeat harness every benchmark suite runs through: rotating order, warm-up runs never
recorded, median / min / max, and a suite's markdown and JSON."""

from __future__ import annotations

import json

import pytest

from mstar.bench import harness
from mstar.bench.harness import Goal, Spread, SuiteResult


def test_rotation_moves_the_first_system_each_repeat():
    systems = ["a", "b", "c"]
    assert [harness.rotation(systems, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert harness.rotation(["x", "y"], 1) == ["y", "x"]  # two systems: the order flips


def test_rotate_runs_every_system_once_per_repeat_none_always_first():
    calls: list[tuple[str, int]] = []
    out = harness.rotate(["a", "b", "c"], lambda s, r: calls.append((s, r)) or f"{s}{r}", 3, warm=False)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]
    assert out == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}
    assert {calls[3 * r][0] for r in range(3)} == {"a", "b", "c"}


def test_warm_up_runs_first_and_is_not_recorded():
    events: list[str] = []
    out = harness.rotate(["a", "b"], lambda s, r: events.append(f"run {s}{r}") or r, 2,
                         warmup=lambda s: events.append(f"warm {s}"), before_first=lambda: events.append("mark"))
    assert events == ["warm a", "warm b", "mark", "run a0", "run b0", "run b1", "run a1"]
    assert out == {"a": [0, 1], "b": [0, 1]}
    # without a warmup callable the warm-up is one unrecorded run of the system itself
    runs: list[str] = []
    out = harness.rotate(["a"], lambda s, r: runs.append(s) or len(runs), 2)
    assert runs == ["a", "a", "a"] and out == {"a": [2, 3]}


def test_warm_each_puts_an_untimed_run_before_every_timed_one():
    events: list[str] = []
    harness.rotate(["a", "b"], lambda s, r: events.append(f"run {s}"), 2, warmup=lambda s: events.append(f"warm {s}"),
                   warm_each=True)
    assert events == ["warm a", "run a", "warm b", "run b", "warm b", "run b", "warm a", "run a"]


def test_rotate_checks_its_arguments_and_logs():
    with pytest.raises(ValueError, match="repeats"):
        harness.rotate(["a"], lambda s, r: 0, 0)
    with pytest.raises(ValueError, match="distinct"):
        harness.rotate(["a", "a"], lambda s, r: 0, 1)
    lines: list[str] = []
    harness.rotate(["a", "b"], lambda s, r: 1.5, 1, warm=False, log=lines.append, label=lambda x: f"{x} s")
    assert lines == ["repeat 1/1 a: 1.5 s", "repeat 1/1 b: 1.5 s"]


def test_rotate_timed_returns_seconds_of_the_timed_calls_only():
    counts = {"f": 0, "g": 0}

    def bump(name):
        return lambda: counts.__setitem__(name, counts[name] + 1)

    times = harness.rotate_timed({"f": bump("f"), "g": bump("g")}, 3)
    assert counts == {"f": 4, "g": 4}  # one warm-up call each + 3 timed
    assert [len(t) for t in times.values()] == [3, 3] and all(x >= 0 for t in times.values() for x in t)
    seconds, value = harness.timed(lambda: 7)
    assert value == 7 and seconds >= 0


def test_spread_median_min_max():
    s = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max) == (2.5, 1.0, 10.0) and s.as_tuple() == (2.5, 1.0, 10.0)
    assert s.cell(".1f") == "2.5 (1.0–10.0)"
    assert Spread.of([4.0]).cell(".0f") == "4 (4–4)"
    with pytest.raises(ValueError):
        Spread.of([])


def test_markdown_table():
    t = harness.markdown_table(["a", "b"], [("x", 1), ("y", 2.5)])
    assert t == "| a | b |\n|---|---:|\n| x | 1 |\n| y | 2.5 |"
    with pytest.raises(ValueError):
        harness.markdown_table(["a", "b"], [("x",)])


def test_suite_result_markdown_and_json(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Figures:
        tok_s: tuple[float, float, float]

    res = SuiteResult("demo", "mstar bench demo", description="what ran",
                      tables=[harness.markdown_table(["x"], [(1,)])],
                      goals=[Goal("ratio >= 2x: 2.50x", True), Goal("ttfa lower: 0.9x", False), Goal("peer", None)],
                      notes=["a note"], data={"fig": Figures((1.0, 0.5, 2.0)), "k": {1: object}})
    md = res.markdown()
    assert md.index("what ran") < md.index("| x |") < md.index("Goals:") < md.index("a note")
    assert "- ratio >= 2x: 2.50x: **met**" in md and "- ttfa lower: 0.9x: **not met**" in md
    assert "- peer: **not measured**" in md
    data = json.loads(res.write_json(tmp_path / "out" / "demo.json").read_text())
    assert data["name"] == "demo" and data["command"] == "mstar bench demo" and data["skipped"] is None
    assert data["goals"][0] == {"text": "ratio >= 2x: 2.50x", "met": True}
    assert data["data"]["fig"] == {"tok_s": [1.0, 0.5, 2.0]} and data["data"]["k"]["1"].startswith("<class")
    skipped = SuiteResult("demo", "cmd", skipped="no peer virtualenv")
    assert skipped.markdown() == "Not run: no peer virtualenv" and skipped.to_json()["skipped"] == "no peer virtualenv"
