"""``mstar bench trace`` on llama-tiny: both runtimes answer, with the same tokens, and the table has
both rows and the ratio."""

from __future__ import annotations

from mstar.bench.trace_bench import format_table, run_trace_bench


def test_trace_bench_times_traced_and_untraced_runtimes():
    res = run_trace_bench("llama-tiny", concurrency=3, max_tokens=4, repeats=1)
    assert res.same_tokens
    assert all(s.median > 0 for s in res.tok_s.values()) and res.ratio > 0
    table = format_table(res)
    assert "| traced |" in table and "| untraced |" in table and "traced / untraced" in table
