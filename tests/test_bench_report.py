"""``make bench``'s report: every registered suite has its block in BENCHMARKS.md, blocks are
replaced in place (idempotently), skipped and failing suites are reported, never silent."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mstar.bench import report, suites
from mstar.bench.harness import Goal, SuiteResult

ROOT = Path(__file__).resolve().parents[1]


def test_every_registered_suite_has_one_block_in_benchmarks_md():
    text = (ROOT / "BENCHMARKS.md").read_text()
    for name in suites.SUITES:
        assert text.count(report.BEGIN.format(name=name)) == 1, name
        assert text.count(report.END.format(name=name)) == 1, name
        assert text.index(report.BEGIN.format(name=name)) < text.index(report.END.format(name=name))


def test_every_bench_subcommand_is_a_suite():
    # `mstar bench X` (and `compare X`) all reach make bench; orpheus is the tts suite without vLLM
    from mstar.cli import bench_cmd, bench_engine_cmd

    names = set()
    for module in (bench_cmd, bench_engine_cmd):
        tree = ast.parse(Path(module.__file__).read_text())
        names |= {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and getattr(n.func, "attr", "") == "add_parser" and n.args and isinstance(n.args[0], ast.Constant)}
    assert {"sampler", "prefix", "compare"} <= names
    compared = {"rollout", "llm", "tts", "t2i", "policy", "omni"}
    assert (names - {"bench", "compare", "orpheus"}) | compared <= set(suites.SUITES)


def _result(body: str = "| a |\n|---|") -> SuiteResult:
    return SuiteResult("llm", "mstar bench compare llm", tables=[body], goals=[Goal("x >= 1: 2", True)])


def test_replace_block_is_in_place_and_idempotent():
    block = report.render_block("llm", _result(), date="2026-01-01", machine="2 cores")
    assert block.startswith(report.BEGIN.format(name="llm")) and block.endswith(report.END.format(name="llm"))
    assert "on 2026-01-01; machine: 2 cores" in block and "```\nmstar bench compare llm\n```" in block
    assert "- x >= 1: 2: **met**" in block
    text = f"# B\n\nhand-written\n\n{report.BEGIN.format(name='llm')}\nold\n{report.END.format(name='llm')}\n\ntail\n"
    once = report.replace_block(text, "llm", block)
    assert "old" not in once and block in once and once.startswith("# B\n\nhand-written") and once.endswith("tail\n")
    assert report.replace_block(once, "llm", block) == once
    appended = report.replace_block("# B\n", "runtime", block, "Runtime")
    assert "\n## Runtime\n" in appended and appended.endswith(report.END.format(name="llm") + "\n")
    with pytest.raises(ValueError, match="markers"):
        report.replace_block(text + report.BEGIN.format(name="llm"), "llm", block)


def test_cli_rejects_unknown_suites(tmp_path, capsys):
    (tmp_path / "B.md").write_text("# B\n")
    with pytest.raises(SystemExit):
        report.main(["--suites", "nope", "--file", str(tmp_path / "B.md")])
    assert "unknown suites" in capsys.readouterr().err


def _placeholder(name: str) -> str:
    return f"{report.BEGIN.format(name=name)}\nNot generated yet.\n{report.END.format(name=name)}\n"


def test_main_writes_blocks_and_json_and_reports_skips_and_failures(tmp_path, monkeypatch, capsys):
    def fail(_repeats):
        raise RuntimeError("boom")

    ran = []
    fake = {
        "good": suites.Suite("Good", lambda r: ran.append(r) or _result("| good |\n|---|")),
        "skip": suites.Suite("Skip", lambda r: SuiteResult("skip", "cmd", skipped="no peer here")),
        "bad": suites.Suite("Bad", fail),
    }
    monkeypatch.setattr(report, "SUITES", fake)
    path = tmp_path / "B.md"
    path.write_text("# B\n\n" + "".join(_placeholder(n) for n in ("good", "skip")))
    status = report.main(["--suites", "good,skip,bad", "--file", str(path), "--repeats", "2",
                          "--json-dir", str(tmp_path / "json")])
    err = capsys.readouterr().err
    assert status == 1 and ran == [2]
    assert "skip skipped: no peer here" in err and "bad failed" in err and "boom" in err
    text = path.read_text()
    assert "| good |" in text and "Not run: no peer here" in text and "## Bad" not in text
    assert json.loads((tmp_path / "json" / "good.json").read_text())["goals"] == [{"text": "x >= 1: 2", "met": True}]
    # a skip keeps a block that holds figures
    good_block = text[text.index(report.BEGIN.format(name="good")):]
    monkeypatch.setitem(fake, "good", suites.Suite("Good", lambda r: SuiteResult("good", "cmd", skipped="gone")))
    assert report.main(["--suites", "good", "--file", str(path), "--json-dir", ""]) == 0
    assert path.read_text().endswith(good_block) and "| good |" in path.read_text()
