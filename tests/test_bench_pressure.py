"""Smoke test of ``mstar bench pressure`` on a toy load: structure and exactness, no timing assertion."""

from mstar.bench import pressure_bench as pb
from mstar.cli.main import main

TOY = {"requests": 6, "prompt_len": (4, 24), "max_tokens": (4, 16), "block_size": 4}


def test_workload_sizes_the_pressure_cache_from_its_demand():
    load = pb.make_workload(6, seed=0, prompt_len=(4, 24), max_tokens=(4, 16), block_size=4)
    assert load.demand_blocks == sum(-(-(len(p) + m) // 4) for p, m in zip(load.prompts, load.max_tokens))
    assert pb.pressure_blocks(load, 4.0) == max(load.largest_blocks, -(-load.demand_blocks // 4))
    assert pb.pressure_blocks(load, 1000.0) == load.largest_blocks  # every request still fits alone
    assert pb.make_workload(6, seed=0, prompt_len=(4, 24), max_tokens=(4, 16), block_size=4) == load
    assert pb.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and pb.percentile([1.0, 2.0], 100) == 2.0


def test_pressure_bench_smoke():
    res = pb.run_pressure_bench(repeats=2, warmup=False, **TOY)
    assert res.blocks["pressure"] * 4 >= res.demand_blocks == res.blocks["large"]
    for runs in res.runs.values():
        assert len(runs) == 2 and all(r.completed == 6 and r.wall_s > 0 and r.forwards > 0 for r in runs)
        assert all(0 < r.latency_ms(50) <= r.latency_ms(99) <= r.wall_s * 1e3 for r in runs)
    assert all(r.preemptions > 0 for r in res.runs["pressure"])
    assert all(r.preemptions == 0 for r in res.runs["large"])
    assert res.same_tokens == 6
    table = pb.format_table(res)
    assert "same tokens: 6/6" in table and "| pressure / large |" in table


def test_bench_pressure_cli(capsys):
    assert main(["bench", "pressure", "--requests", "4", "--repeats", "1", "--prompt-len", "4,12",
                 "--max-tokens", "4,8", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "| pressure |" in out and "| large |" in out and "same tokens: 4/4" in out
