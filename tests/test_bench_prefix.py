"""``mstar bench prefix`` at test size: both systems run the same chats, only the cached one hits."""

from mstar.bench.prefix_bench import format_table, run_prefix_bench


def test_prefix_bench_small_run():
    res = run_prefix_bench(requests=3, system_tokens=40, user_tokens=(2, 5), max_tokens=2, repeats=1, block_size=8)
    assert res.same_tokens
    (cached,), (uncached,) = res.runs["cached"], res.runs["uncached"]
    # 6 prompts per run (sequential, then burst), each reusing the 5 cached blocks of the system prompt
    assert cached.hit_tokens == 6 * 40 and uncached.hit_tokens == 0
    assert cached.query_tokens > cached.hit_tokens and uncached.query_tokens == 0  # off: no lookups
    assert len(cached.ttft_s) == 3 and len(cached.tokens) == 6 and all(len(t) == 2 for t in cached.tokens)
    table = format_table(res)
    assert "| cached / uncached |" in table and "same tokens with and without the cache: yes" in table
