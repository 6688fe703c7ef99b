"""``python -m mstar.bench.tp_bench`` (or ``mstar bench tp``): one decode step at TP1 and TP2 on CPU.

Two gloo processes on 127.0.0.1, one torch thread each. Both build the same seeded Llama node (the
``compare llm`` shape: hidden 512, 8 layers, 8:4 heads, vocab 32000; or llama-tiny), fill a paged KV
cache with ``batch`` prompts of ``context`` tokens, and time one decode step (backbone + LM head):

* **TP1**: the dense node on rank 0 alone (rank 1 waits);
* **TP2**: the node after ``apply_tp`` on both ranks (each step: 2 all-reduces per layer, one for
  the embedding, one all-gather of the logits);
* **all-reduce**: one ``[batch, hidden]`` fp32 all-reduce, the unit of the per-layer cost;
* **all-gather**: the logits' ``[batch, vocab / 2]`` halves gathered (once per step).

Figures are medians over ``repeats`` (min-max), in ms. On a 2-core machine TP2 is not expected to
be faster: the point is what the collectives cost per step and per layer.

``--runtime``: the same shape served end to end (worker processes, ``Runtime.generate``), TP1 on
one rank vs TP2 on two, one thread per rank (the leader's scheduling and its calls mirrored to
the follower included):
``batch`` requests submitted together, ms per step = wall time / ``max_tokens`` steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from mstar.bench import harness
from mstar.bench.net import free_port
from mstar.bench.stats import spread, spread_cell

__all__ = ["format_runtime_table", "format_table", "main", "run", "run_runtime_bench", "run_tp_bench"]


def _median_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """ms per call over ``repeats`` timed calls after one warm-up (the harness; one configuration at a
    time, as the ranks must run the same collectives in the same order)."""
    return [t * 1e3 for t in harness.rotate_timed({"step": fn}, repeats)["step"]]


def _node(shape: str):
    from mstar.bench.llm_bench import BENCH_SHAPE
    from mstar.models.llama.config import TINY, LlamaConfig
    from mstar.models.llama.loader import build_llama_model

    config = TINY if shape == "tiny" else LlamaConfig.from_hf_dict(BENCH_SHAPE.hf_config(), source="bench")
    return build_llama_model(config, load_format="dummy", seed=0)


class _DecodeStep:
    """``batch`` sequences of ``context`` tokens in a paged cache; ``__call__`` runs one decode step."""

    def __init__(self, node, batch: int, context: int, block_size: int = 16) -> None:
        from mstar.layers.paged_attention import AttentionMetadata, QueryMode
        from mstar.model.submodule import EngineInputs

        spec, self.node = node.kv_spec, node
        per_seq = -(-(context + 1) // block_size)
        shape = (batch * per_seq, block_size, spec.num_kv_heads, spec.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        slot = [t[p // block_size] * block_size + p % block_size for t in tables for p in range(context)]

        def inputs(n: int, slots: list[int], positions: list[int], ctx: int) -> EngineInputs:
            meta = AttentionMetadata.build([n] * batch, tables, [ctx] * batch, [QueryMode.CAUSAL_APPEND] * batch,
                                           slots)
            return EngineInputs(walks=["decode"] * batch, nodes=["LLM"] * batch, request_ids=list(map(str, range(batch))),
                                infos=[], splits={}, args=[], attention=meta, kv_caches=caches,
                                positions=torch.tensor(positions), num_tokens=[n] * batch)

        gen = torch.Generator().manual_seed(1)
        vocab = node.config.vocab_size
        self._run(torch.randint(3, vocab, (batch * context,), generator=gen),
                  inputs(context, slot, list(range(context)) * batch, context))
        last = [t[context // block_size] * block_size + context % block_size for t in tables]
        self.ids = torch.randint(3, vocab, (batch,), generator=gen)
        self.ei = inputs(1, last, [context] * batch, context + 1)

    def _run(self, ids, ei) -> torch.Tensor:
        with torch.inference_mode():
            return self.node.compute_logits(self.node.model(ids, ei)[ei.last_token_rows()])

    def __call__(self) -> torch.Tensor:
        return self._run(self.ids, self.ei)


def _rank_main(rank: int, port: int, out: str, shape: str, batch: int, context: int, repeats: int) -> None:
    import torch.distributed as dist

    from mstar.layers.tensor_parallel import TPGroup, apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        node = _node(shape)
        res = {"layers": node.config.num_hidden_layers}
        if rank == 0:
            res["tp1"] = _median_ms(_DecodeStep(node, batch, context), repeats)
        dist.barrier()
        x = torch.randn(batch, node.config.hidden_size)
        res["all_reduce"] = _median_ms(lambda: dist.all_reduce(x), repeats)
        tp = TPGroup(rank, 2)
        shard = torch.randn(batch, -(-node.config.vocab_size // 2))
        res["all_gather"] = _median_ms(lambda: tp.all_gather_last(shard), repeats)
        apply_tp(node, tp)
        res["tp2"] = _median_ms(_DecodeStep(node, batch, context), repeats)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_tp_bench(shape: str = "bench", batch: int = 16, context: int = 128, repeats: int = 20) -> dict:
    """Spawn the two ranks; rank 0's figures (ms lists) plus the layer count."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mstar-tp-bench-") as out:
        mp.start_processes(_rank_main, args=(free_port(), out, shape, batch, context, repeats), nprocs=2,
                           start_method="spawn")
        res = torch.load(Path(out) / "rank0.pt")
    return {**res, "shape": shape, "batch": batch, "context": context, "repeats": repeats}


def format_table(res: dict) -> str:
    layers = res["layers"]
    reduces = 2 * layers + 1
    tp1, tp2, ar, ag = (statistics.median(res[k]) for k in ("tp1", "tp2", "all_reduce", "all_gather"))
    lines = [f"decode step, {res['shape']} shape, batch {res['batch']}, context {res['context']}, "
             f"{res['repeats']} repeats, gloo over 127.0.0.1, 1 thread per rank (ms, median (min-max))",
             "| | ms |", "|---|---|",
             f"| TP1 step | {spread_cell(spread(res['tp1']))} |",
             f"| TP2 step | {spread_cell(spread(res['tp2']))} |",
             f"| one all-reduce [{res['batch']}, hidden] | {spread_cell(spread(res['all_reduce']))} |",
             f"| logits all-gather [{res['batch']}, vocab / 2] x 2 | {spread_cell(spread(res['all_gather']))} |",
             f"| TP2 - TP1 per step | {tp2 - tp1:.3f} |",
             f"| collectives per TP2 step | {reduces} all-reduces ({layers} layers x 2 + embedding) + 1 all-gather |",
             f"| collective cost per step (all-reduces + all-gather) | {reduces * ar + ag:.3f} |",
             f"| all-reduce cost per layer (2 x one all-reduce) | {2 * ar:.3f} |"]
    return "\n".join(lines)


def _llm(shape: str):
    from mstar.bench.llm_bench import BENCH_SHAPE
    from mstar.models.llama.model import LlamaLM, LlamaTiny

    return LlamaTiny() if shape == "tiny" else LlamaLM(config=BENCH_SHAPE.hf_config(), load_format="dummy")


def run_runtime_bench(shape: str = "bench", batch: int = 16, max_tokens: int = 32, repeats: int = 3) -> dict:
    """ms per step of ``batch`` greedy requests through ``Runtime`` at TP1 and TP2 (per repeat)."""
    from mstar.placement import Placement
    from mstar.runtime import Runtime

    os.environ["OMP_NUM_THREADS"] = "1"  # every rank one thread (TP2 ranks get one each on 2 cores anyway)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"input_ids": torch.randint(3, 250, (32,), generator=gen)} for _ in range(batch)]
    params = {"max_tokens": max_tokens, "sampling": {"ignore_eos": True}}
    out: dict[str, list[float]] = {}
    for tp in (1, 2):
        placement = Placement.from_dict({"node_groups": [{"node_names": ["LLM"], "ranks": list(range(tp)),
                                                          "tp_size": tp}]})
        with Runtime(_llm(shape), placement, workers="process") as rt:
            def batch(rt=rt) -> None:
                with rt.held():
                    handles = [rt.submit(p, params) for p in prompts]
                for h in handles:
                    assert h.result().finished

            times = harness.rotate([tp], lambda _s, _r, run=batch: harness.timed(run)[0], repeats,
                                   warmup=lambda _s, rt=rt: rt.generate(prompts[:1], {"max_tokens": 2}))[tp]
            out[f"tp{tp}"] = [t * 1e3 / max_tokens for t in times]
    return {**out, "shape": shape, "batch": batch, "max_tokens": max_tokens, "repeats": repeats}


def format_runtime_table(res: dict) -> str:
    lines = [f"served step, {res['shape']} shape, {res['batch']} requests x {res['max_tokens']} tokens, "
             f"{res['repeats']} repeats, worker processes, 1 thread per rank (ms per step, median (min-max))",
             "| | ms / step |", "|---|---|",
             f"| TP1 (1 rank) | {spread_cell(spread(res['tp1']))} |",
             f"| TP2 (2 ranks, gloo) | {spread_cell(spread(res['tp2']))} |"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=["bench", "tiny"], default="bench",
                   help="the compare-llm Llama shape (hidden 512, 8 layers) or llama-tiny (default bench)")
    p.add_argument("--batch", type=int, default=16, help="decode rows per step (default 16)")
    p.add_argument("--context", type=int, default=128, help="tokens already in each sequence's cache (default 128)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per configuration (default 20)")
    p.add_argument("--runtime", action="store_true",
                   help="serve the shape through Runtime at TP1 and TP2 instead (repeats = timed batches)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request with --runtime (default 32)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tp_bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.runtime:
        print(format_runtime_table(run_runtime_bench(args.shape, args.batch, args.max_tokens, args.repeats)))
    else:
        print(format_table(run_tp_bench(args.shape, args.batch, args.context, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
