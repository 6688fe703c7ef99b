"""The ``mstar bench`` subcommands that measure the engine alone, with no peer: ``pressure``
(pressure_bench.py), ``prefix`` (prefix_bench.py), ``plan`` (plan_bench.py), ``sampler`` (sampler_bench.py), ``soak``
(soak_bench.py), ``tp`` (tp_bench.py), ``transport`` (transport_bench.py); ``bench_cmd`` mounts them."""

from __future__ import annotations

import argparse
import sys


def int_list(flag: str):
    """An argparse type: comma-separated positive ints (``flag`` names the option in errors)."""
    def parse(text: str) -> list[int]:
        try:
            vals = [int(v) for v in text.split(",") if v.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated ints, got {text!r}") from e
        if not vals or min(vals) < 1:
            raise argparse.ArgumentTypeError(f"{flag} takes positive ints, got {text!r}")
        return vals

    return parse



def _add_pressure(bsub) -> None:
    pr = bsub.add_parser("pressure", help="llama-tiny with KV oversubscribed vs. a cache large enough for all",
                         description="N mixed greedy requests whose KV demand is a multiple of the cache, vs. "
                                     "the same load with a cache for everything, alternating in one run: "
                                     "completion, tokens/s, p50/p99 latency, preemptions, same tokens.")
    pr.add_argument("--requests", type=int, default=32, help="requests, all submitted at once (default 32)")
    pr.add_argument("--oversubscription", type=float, default=4.0,
                    help="KV demand / the pressure cache's blocks (default 4)")
    pr.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    pr.add_argument("--model", choices=["tiny", "scaled"], default="tiny",
                    help="llama-tiny, or its config scaled to hidden 256 / 4 layers (default tiny)")
    pr.add_argument("--prompt-len", type=int_list("--prompt-len"), default=[16, 192], help="LO,HI (default 16,192)")
    pr.add_argument("--max-tokens", type=int_list("--max-tokens"), default=[16, 128], help="LO,HI (default 16,128)")
    pr.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    pr.add_argument("--seed", type=int, default=0, help="prompts and lengths seed (default 0)")
    pr.set_defaults(func=run_pressure)


def run_pressure(args: argparse.Namespace) -> int:

    from mstar.bench.pressure_bench import format_table, run_pressure_bench

    for flag, pair in (("--prompt-len", args.prompt_len), ("--max-tokens", args.max_tokens)):
        if len(pair) != 2:
            raise ValueError(f"{flag} takes two ints, LO,HI; got {pair}")
    res = run_pressure_bench(args.requests, args.oversubscription, args.repeats, args.seed, args.model,
                             args.block_size, tuple(args.prompt_len), tuple(args.max_tokens),
                             log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(res))
    return 0


def _add_prefix(bsub) -> None:
    pf = bsub.add_parser("prefix", help="chats sharing a long system prompt with prefix caching on vs. off",
                         description="N greedy chats sharing one system prompt, with automatic prefix caching "
                                     "and without it, alternating in one run: time to first token one request "
                                     "at a time, wall time of all at once, hit rate, same tokens.")
    pf.add_argument("--requests", type=int, default=16, help="chats per load (default 16)")
    pf.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length (default 512)")
    pf.add_argument("--user-tokens", type=int_list("--user-tokens"), default=[8, 32],
                    help="LO,HI of each chat's own tokens (default 8,32)")
    pf.add_argument("--max-tokens", type=int, default=8, help="tokens generated per chat (default 8)")
    pf.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    pf.add_argument("--model", choices=["tiny", "scaled"], default="tiny",
                    help="llama-tiny, or its config scaled to hidden 256 / 4 layers (default tiny)")
    pf.add_argument("--seed", type=int, default=0)
    pf.set_defaults(func=run_prefix)


def run_prefix(args: argparse.Namespace) -> int:

    from mstar.bench.prefix_bench import format_table, run_prefix_bench

    if len(args.user_tokens) != 2:
        raise ValueError(f"--user-tokens takes two ints, LO,HI; got {args.user_tokens}")
    res = run_prefix_bench(args.requests, args.system_tokens, tuple(args.user_tokens), args.max_tokens,
                           args.repeats, args.model, seed=args.seed,
                           log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(res))
    return 0 if res.same_tokens else 1


def _add_soak(bsub) -> None:
    sk = bsub.add_parser("soak", help="mixed load with hostile bodies, disconnects and aborts, then a leak audit",
                         description="Send a bounded number of mixed requests concurrently (chat whole and "
                                     "streamed, speech, /generate, hostile bodies that must get a 4xx, clients "
                                     "that leave mid-stream or cancel), count outcomes, and compare resources "
                                     "before and after: KV blocks, walks, stream buffers, /dev/shm files, file "
                                     "descriptors, threads, RSS. Exits 1 on an unexpected outcome or a leak.")
    sk.add_argument("--url", default=None, help="a running server (only what its /metrics shows is audited)")
    sk.add_argument("--model", default="llama-tiny",
                    help="model id; without --url, the registered model served in this process (default llama-tiny)")
    sk.add_argument("--requests", type=int, default=2000, help="requests in all (default 2000)")
    sk.add_argument("--concurrency", type=int, default=32, help="requests kept in flight (default 32)")
    sk.add_argument("--kinds", default=None, help="comma-separated request kinds (default: every kind the "
                    "model's routes serve; with --url, all of chat,chat-stream,speech,generate,hostile,disconnect,abort)")
    sk.add_argument("--max-tokens", type=int, default=16, help="most new tokens per request (default 16)")
    sk.add_argument("--max-queue", type=int, default=256, help="in-process server: requests in flight before 429")
    sk.add_argument("--workers", choices=["inline", "process"], default="inline",
                    help="in-process server: runtime mode (default inline)")
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--api-key", default=None, help="with --url: the server's API key")
    sk.add_argument("--out", default=None, help="also write the report as JSON to this file")
    sk.set_defaults(func=run_soak)


def run_soak(args: argparse.Namespace) -> int:
    import json

    from mstar.bench.soak_bench import format_report, run_soak, soak_in_process

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    if args.url:
        report = run_soak(args.url, args.model, args.requests, args.concurrency, kinds=kinds, seed=args.seed,
                          max_tokens=args.max_tokens, api_key=args.api_key)
    else:
        report = soak_in_process(args.model, args.model, args.requests, args.concurrency, workers=args.workers,
                                 max_queue=args.max_queue, kinds=kinds, seed=args.seed, max_tokens=args.max_tokens,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["errors"] or report["leaks"] else 0


def _add_tp(bsub) -> None:
    from mstar.bench.tp_bench import add_arguments

    tp = bsub.add_parser("tp", help="one decode step at TP1 vs TP2 (2 gloo processes) and the all-reduce cost",
                         description="Time one decode step of a Llama node dense on one rank and sharded over "
                                     "two gloo ranks (apply_tp), and one all-reduce of the step's hidden states.")
    add_arguments(tp)
    tp.set_defaults(func=run_tp)


def run_tp(args: argparse.Namespace) -> int:
    from mstar.bench.tp_bench import run

    return run(args)


def _add_plan(bsub) -> None:
    from mstar.bench.plan_bench import add_arguments

    pl = bsub.add_parser("plan", help="the placement planner's predictions vs. replays through the runtime, "
                                      "and its plan's goodput vs. a naive placement",
                         description="Profile each tiny model, compare the simulator's p50 / p95 with replays "
                                     "of the same arrivals on two placements and two workloads, and the goodput "
                                     "of `mstar plan`'s placement with everything on every rank.")
    add_arguments(pl)
    pl.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from mstar.bench.plan_bench import run

    return run(args)


def _add_sampler(bsub) -> None:
    sm = bsub.add_parser("sampler", help="decode throughput with the OpenAI sampling options or a JSON schema on "
                                         "every row vs. none",
                         description="The same concurrent greedy requests with no sampling option, with presence "
                                     "+ frequency penalties, a 50-token logit_bias and top_logprobs 5 on every row, "
                                     "and constrained to a JSON schema, alternating in one run: generated tokens "
                                     "per second; and a schema's compile time.")
    sm.add_argument("--concurrency", type=int, default=16, help="concurrent requests (default 16)")
    sm.add_argument("--max-tokens", type=int, default=128, help="tokens per request, EOS ignored (default 128)")
    sm.add_argument("--repeats", type=int, default=3, help="alternating repeats (default 3)")
    sm.set_defaults(func=run_sampler)


def run_sampler(args: argparse.Namespace) -> int:

    from mstar.bench.sampler_bench import format_table, goal_lines, run_sampler_bench

    res = run_sampler_bench(concurrency=args.concurrency, max_tokens=args.max_tokens,
                            repeats=args.repeats, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(res))
    for goal in goal_lines(res):
        print(goal.line())
    return 0


def _add_transport(bsub) -> None:
    tr = bsub.add_parser("transport", help="one tensor message per path (in-process, IPC, shm, TCP) vs. memcpy "
                                           "and a loopback socket",
                         description="Median time per message of one uint8 tensor (sent, decoded by a peer "
                                     "process, acknowledged) through each transport path, as GB/s, next to a "
                                     "single-threaded memcpy and a plain loopback TCP socket (into a warm "
                                     "buffer, and into a new one per message).")
    tr.add_argument("--sizes", default="4K,64K,1M,16M,64M",
                    help="comma-separated sizes in bytes, K/M suffixes allowed (default 4K,64K,1M,16M,64M)")
    tr.add_argument("--paths", default="inline,ipc,shm,tcp", help="comma-separated paths (default all)")
    tr.add_argument("--out", default=None, help="also write the results as JSON to this file")
    tr.set_defaults(func=run_transport)


def run_transport(args: argparse.Namespace) -> int:
    import json

    from mstar.bench.transport_bench import PATHS, format_table, parse_sizes, run_transport_bench

    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths takes some of {', '.join(PATHS)}; got {args.paths!r}")
    rows = run_transport_bench(parse_sizes(args.sizes), paths)
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{"size": r.size, "seconds": r.seconds} for r in rows], f, indent=1)
    return 0


# the subcommands ``bench_cmd.add_parser`` mounts from here, in its order
ENGINE_BENCHES = (_add_pressure, _add_prefix, _add_plan, _add_sampler, _add_soak, _add_tp, _add_transport)
