"""Smoke test of ``mstar bench orpheus``: structure and positive figures, no timing assertion."""

import json

import pytest

pytest.importorskip("transformers")

from mstar.bench import orpheus_bench  # noqa: E402
from mstar.bench.orpheus_bench import SYSTEMS, format_table, run_orpheus_bench  # noqa: E402
from mstar.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def tiny_result():
    return run_orpheus_bench([2], tokens=35, warmup=False, hidden=64, layers=2, head_dim=16)


def test_orpheus_bench_smoke(tiny_result):
    res = tiny_result
    assert (res.tokens, res.hidden, res.layers, res.head_dim, res.workers) == (35, 64, 2, 16, "inline")
    [r] = res.results
    assert r.concurrency == 2 and set(r.systems) == set(SYSTEMS)
    for s in r.systems.values():
        assert s.concurrency == 2 and s.tokens_per_request == 35
        assert s.throughput > 0 and s.wall_s > 0 and s.audio_s_per_request > 0 and s.rtf_p50 > 0
        assert 0 < s.ttfa_p50_ms <= s.ttfa_p95_ms
        assert len(s.raw["ttfa_ms"]) == 2
    # 35 tokens = 5 frames: the stream emits frames 1..2, the baselines decode all 5 (unless a sampled
    # stop token cost a frame, which is rare)
    spf = res.samples_per_frame
    assert r.systems["mstar"].audio_s_per_request <= 2 * spf / 24000
    assert 4 * spf / 24000 <= r.systems["hf-static-batch"].audio_s_per_request <= 5 * spf / 24000
    assert set(r.throughput_ratio) == set(r.ttfa_ratio) == {"hf-sequential", "hf-static-batch"}
    assert all(v > 0 for v in [*r.throughput_ratio.values(), *r.ttfa_ratio.values()])
    table = format_table(res)
    assert "concurrency 2:" in table and "| mstar |" in table and "| hf-sequential |" in table


def test_orpheus_bench_cli(tiny_result, monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(concurrency, **kw):
        seen.update(kw, concurrency=concurrency)
        return tiny_result

    monkeypatch.setattr(orpheus_bench, "run_orpheus_bench", fake)
    out = tmp_path / "r.json"
    argv = ["bench", "orpheus", "--concurrency", "2,3", "--tokens", "35", "--hidden", "64", "--layers", "2",
            "--head-dim", "16", "--workers", "process", "--out", str(out)]
    assert main(argv) == 0
    assert seen["concurrency"] == [2, 3] and seen["workers"] == "process"
    assert (seen["tokens"], seen["hidden"], seen["layers"], seen["head_dim"]) == (35, 64, 2, 16)
    lines = capsys.readouterr().out.splitlines()
    assert "| hf-static-batch |" in "\n".join(lines)
    data = json.loads(lines[-1])
    assert data["results"][0]["concurrency"] == 2 and json.loads(out.read_text()) == data
