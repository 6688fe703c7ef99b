"""``mstar bench runtime``: measure the runtime's per-step overhead (see mstar/bench/runtime_bench.py)."""

from __future__ import annotations

import argparse


def _batches(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--batch takes comma-separated ints, got {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"--batch takes positive ints, got {text!r}")
    return vals


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    r = bsub.add_parser("runtime", help="runtime overhead per step and vs. a bare loop",
                        description="Runtime overhead: (a) us per step of a trivial node loop; "
                                    "(b) end-to-end time of an MLP-node loop vs. a bare Python loop.")
    r.add_argument("--batch", type=_batches, default=[1, 16], help="comma-separated batch sizes (default 1,16)")
    r.add_argument("--iters", type=int, default=200, help="loop iterations = steps per run (default 200)")
    r.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    r.add_argument("--hidden", type=int, default=512, help="hidden size of the MLP node (default 512)")
    r.add_argument("--layers", type=int, default=8, help="MLP layers of the work node (default 8)")
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mstar.bench.runtime_bench import format_table, run_runtime_bench

    res = run_runtime_bench(args.batch, iters=args.iters, repeats=args.repeats, hidden=args.hidden,
                            layers=args.layers)
    print(format_table(res))
    return 0
