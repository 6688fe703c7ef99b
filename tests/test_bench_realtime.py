"""``mstar bench realtime`` on qwen3-omni-tiny, unpaced (the audio as fast as it goes): both systems
answer every turn, the warm-up turn alike both ways, and the table has a row per level."""

from __future__ import annotations

from mstar.bench.realtime_bench import format_table, run_realtime_bench


def test_realtime_bench_times_both_systems_per_level(monkeypatch):
    monkeypatch.setenv("MSTAR_KERNELS", "torch")  # no C++ kernel build in the server's workers
    res = run_realtime_bench("qwen3-omni-tiny", sessions=(1, 2), turn_s=1.0, segment_ms=500, max_tokens=3,
                             pace=False)
    assert res.same_answer
    assert [lv.sessions for lv in res.levels] == [1, 2]
    for lv in res.levels:
        assert len(lv.realtime_ms) == len(lv.chat_ms) == lv.sessions
        assert all(t > 0 for t in lv.realtime_ms + lv.chat_ms)
    table = format_table(res)
    assert table.count("\n| 1 |") == 1 and table.count("\n| 2 |") == 1 and "alike both ways: yes" in table


def test_realtime_bench_refuses_bad_arguments(capsys):
    from mstar.cli.main import main

    assert main(["bench", "realtime", "--turn-s", "0"]) == 2
    assert "--turn-s must be > 0" in capsys.readouterr().err
