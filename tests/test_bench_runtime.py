"""Smoke test of ``mstar bench runtime``: structure and positive times, no timing assertion."""

from mstar.bench.runtime_bench import format_table, run_runtime_bench
from mstar.cli.main import main


def test_runtime_bench_smoke():
    res = run_runtime_bench([2], iters=5, repeats=1, hidden=8)
    assert (res.iters, res.repeats, res.hidden) == (5, 1, 8)
    [r] = res.results
    assert r.batch == 2
    assert r.step_hist == {2: 5} and r.matmul_hist == {2: 5}  # every step was one batch of size 2
    for s in (r.step_us, r.runtime_ms, r.bare_ms):
        assert 0 < s.min <= s.median <= s.max
    assert r.overhead_pct.min <= r.overhead_pct.median <= r.overhead_pct.max
    table = format_table(res)
    assert table.count("\n| 2 |") == 1 and "us/step" in table


def test_bench_cli(capsys):
    assert main(["bench", "runtime", "--batch", "2", "--iters", "5", "--repeats", "1", "--hidden", "8"]) == 0
    out = capsys.readouterr().out
    assert "| batch |" in out and "\n| 2 |" in out


def test_rollout_bench_smoke():
    from mstar.bench.rollout_bench import format_table, run_rollout_bench

    res = run_rollout_bench([2, 3], repeats=1, embed=64, width=48, depth=1, heads=4, grid=2)
    assert [r.horizon for r in res] == [2, 3] and all(r.mstar_s > 0 and r.native_s > 0 for r in res)
    assert all(r.max_diff < 1e-4 for r in res)  # the cached rollout reproduces the native one
    assert res[1].work_ratio == 2.0 and "| 3 | 1 |" in format_table(res)
