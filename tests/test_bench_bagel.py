"""The BAGEL benchmark runs end to end on tiny settings and checks ours against the oracle."""

from mstar.bench.bagel_bench import format_i2t, format_t2i, run_i2t, run_t2i_compare


def test_t2i_compare_agrees_with_the_oracle_and_formats():
    rows = run_t2i_compare((1, 2), repeats=1, size=16, steps=3, progress=lambda *_: None)
    assert [r.batch for r in rows] == [1, 2]
    for r in rows:
        assert r.max_diff < 1e-4 and len(r.ours_s) == len(r.oracle_s) == 1 and r.ratios[0] > 0
    table = format_t2i(rows)
    assert table.splitlines()[0].startswith("| batch | ours s/batch | oracle s/batch") and "| 2 |" in table


def test_i2t_reports_ttft_and_rate():
    rows = run_i2t((1, 3), repeats=1, max_tokens=3, progress=lambda *_: None)
    assert [r.batch for r in rows] == [1, 3]
    assert all(r.ttft_ms[0] > 0 and r.tok_s[0] > 0 for r in rows)
    assert "| 3 |" in format_i2t(rows)
