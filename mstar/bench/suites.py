"""Every benchmark suite as ``make bench`` runs it: one function per suite, at the suite's default
sizes, returning a ``harness.SuiteResult`` (the command, its tables, its goals judged from the
measured figures, the figures as JSON). ``mstar.bench.report`` runs them and writes the blocks of
BENCHMARKS.md; a suite whose prerequisite is missing returns a result with ``skipped`` set, and the
reason is printed and written into its block.

``repeats`` (``--repeats`` of the report): None runs each suite's default number of repeats.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

from mstar.bench.harness import Goal, SuiteResult


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _n(repeats: int | None, default: int) -> int:
    return repeats or default


def _fewer(repeats: int | None, default: int) -> list[str]:
    return [f"Run with `--repeats {repeats}` (the suite's default is {default})."] if repeats and repeats < default else []


# -- the suites -------------------------------------------------------------------------------------------
def suite_runtime(repeats: int | None) -> SuiteResult:
    from mstar.bench.runtime_bench import format_table, run_runtime_bench

    n = _n(repeats, 3)
    res = run_runtime_bench([1, 16], iters=200, repeats=n, hidden=512, layers=8)
    top = res.results[-1]
    goals = [Goal(f"(a) runtime time per step at batch {r.batch} <= 200 us: {r.step_us.median:.1f} us",
                  r.step_us.median <= 200) for r in res.results]
    goals.append(Goal(f"(b) overhead over the bare loop at batch {top.batch} <= 10%: {top.overhead_pct.median:.1f}%",
                      top.overhead_pct.median <= 10))
    return SuiteResult("runtime", f"mstar bench runtime --batch 1,16 --iters 200 --repeats {n} --hidden 512 --layers 8",
                       tables=[format_table(res)], goals=goals, notes=_fewer(repeats, 3), data=res)


def suite_llm(repeats: int | None) -> SuiteResult:
    from mstar.bench.llm_bench import GOALS, OVERHEAD_GOAL_US, describe, format_table, run_llm_bench, to_json

    n = _n(repeats, 3)
    res = run_llm_bench(repeats=n, log=_log)
    goals = []
    for w, target in GOALS.items():
        st = res.get("vllm-cpu", w)
        got = "vLLM CPU not run" if st is None else f"{st.ratio[0]:.2f}x ({st.ratio[1]:.2f}–{st.ratio[2]:.2f})"
        goals.append(Goal(f"{w}: ours / vLLM CPU tok/s >= {target:.1f}x: {got}",
                          None if st is None else st.ratio[0] >= target))
    if res.overhead is not None:
        oh = res.overhead
        goals.append(Goal(f"mstar's runtime time per decode step outside the forward, {res.concurrency} concurrent, "
                          f"<= {OVERHEAD_GOAL_US} us: {oh.in_step_us:.0f} + {oh.between_steps_us:.0f} between steps "
                          f"= {oh.total_us:.0f} us", oh.total_us <= OVERHEAD_GOAL_US))
    return SuiteResult("llm", f"mstar bench compare llm --repeats {n}", description=describe(res),
                       tables=[format_table(res)], goals=goals, notes=_fewer(repeats, 3), data=to_json(res))


def suite_gguf(repeats: int | None) -> SuiteResult:
    from dataclasses import asdict

    from mstar.bench import gguf_bench as g

    n = _n(repeats, 3)
    res = g.run_gguf_bench(repeats=n, log=_log)
    goals = [Goal(text, met) for text, met in g.goal_checks(res)]
    return SuiteResult("gguf", f"mstar bench compare gguf --repeats {n}", description=g.describe(res),
                       tables=[g.format_table(res), g.format_memory(res), g.format_parity(res)], goals=goals,
                       notes=_fewer(repeats, 3), data=asdict(res))


def suite_tts(repeats: int | None) -> SuiteResult:
    from mstar.bench.orpheus_bench import HF_SYSTEMS, SYSTEMS, VLLM, format_table, run_orpheus_bench, to_json

    n = _n(repeats, 1)
    res = run_orpheus_bench([1, 4, 16], tokens=140, repeats=n, log=_log, systems=(*SYSTEMS, VLLM), head="full")
    top = res.results[-1]
    hf_tput = min(top.throughput_ratio[s] for s in HF_SYSTEMS)
    hf_ttfa = min(top.ttfa_ratio[s] for s in HF_SYSTEMS)
    goals = [Goal(f"audio throughput at {top.concurrency} >= 1.2x vLLM CPU + SNAC, with a lower TTFA p50: "
                  + (f"{top.throughput_ratio[VLLM]:.2f}x, TTFA {top.ttfa_ratio[VLLM]:.2f}x lower"
                     if top.goal_vllm is not None else "vLLM CPU not run"), top.goal_vllm),
             Goal(f"audio throughput at {top.concurrency} >= 3x the better HF baseline: {hf_tput:.2f}x",
                  top.goal_throughput_3x),
             Goal(f"TTFA p50 at {top.concurrency} >= 5x lower than the HF baselines': {hf_ttfa:.2f}x", top.goal_ttfa_5x)]
    return SuiteResult("tts", f"mstar bench compare tts --repeats {n}", tables=[format_table(res)], goals=goals,
                       data=to_json(res))


def suite_rollout(repeats: int | None) -> SuiteResult:
    from mstar.bench.rollout_bench import format_compare, run_rollout_compare

    n = _n(repeats, 1)
    rows, cem = run_rollout_compare([4, 15, 30], [1, 8], repeats=n)
    goals = [Goal(f"H={r.horizon}, B={r.batch}: mstar >= 15x the reference's native rollout: {r.speedup:.2f}x",
                  r.speedup >= 15) for r in rows if r.horizon == 30]
    return SuiteResult("rollout", f"mstar bench compare rollout --horizons 4,15,30 --batches 1,8 --repeats {n}",
                       tables=[format_compare(rows, cem)], goals=goals, data={"rows": rows, "cem": cem})


def suite_t2i(repeats: int | None) -> SuiteResult:
    from mstar.bench.bagel_bench import format_i2t, format_t2i, run_i2t, run_t2i_compare

    n = _n(repeats, 3)
    t2i = run_t2i_compare([1, 4], repeats=n, size=64, steps=50, progress=_log)
    i2t = run_i2t([1, 2, 4, 8, 16], repeats=n, max_tokens=32, progress=_log)
    goals = [Goal(f"text-to-image B={r.batch}: >= 1.5x faster than the oracle loop: "
                  f"{statistics.median(r.ratios):.2f}x", statistics.median(r.ratios) >= 1.5) for r in t2i]
    return SuiteResult("t2i", f"mstar bench compare t2i --repeats {n}", tables=[format_t2i(t2i), format_i2t(i2t)],
                       goals=goals, notes=_fewer(repeats, 3), data={"t2i": t2i, "i2t": i2t})


def suite_policy(repeats: int | None) -> SuiteResult:
    from mstar.bench.policy_bench import (
        ReferenceUnavailable,
        format_compare,
        reference_python,
        run_policy_compare,
    )

    n = _n(repeats, 3)
    cmd = f"mstar bench compare policy --rounds {n}"
    try:
        reference_python()
    except ReferenceUnavailable as e:
        return SuiteResult("policy", cmd, skipped=str(e))
    tables, goals, data = [], [], {}
    for size in ("small", "medium"):
        res = run_policy_compare([1, 8], size, rounds=n)
        ref, (one, eight) = res.reference, res.mstar
        tables.append(f"{size} model:\n\n{format_compare(res)}")
        p50 = one.percentile(50) / ref.percentile(50)
        tput = eight.chunks_per_s / ref.chunks_per_s
        goals += [Goal(f"{size}: p50 latency at 1 client <= 1.1x the reference's: {p50:.2f}x", p50 <= 1.1),
                  Goal(f"{size}: throughput at 8 clients >= 3x the reference's: {tput:.2f}x", tput >= 3)]
        data[size] = res
    return SuiteResult("policy", cmd, tables=tables, goals=goals, notes=_fewer(repeats, 3), data=data)


def suite_omni(repeats: int | None) -> SuiteResult:
    from mstar.bench.omni_bench import bench_hf_config, format_table, goals, run_omni_bench, to_json

    n = _n(repeats, 2)
    res = run_omni_bench([1, 4, 16], repeats=n, config=bench_hf_config(), log=_log)
    return SuiteResult("omni", f"mstar bench compare omni --repeats {n}", tables=[format_table(res)],
                       goals=[Goal(text, ok) for text, ok in goals(res)], notes=_fewer(repeats, 2),
                       data=to_json(res))


def suite_serve(repeats: int | None) -> SuiteResult:
    from mstar.bench.serve_bench import format_table, run_serve_bench
    from mstar.bench.soak_bench import serving

    with serving("llama-tiny", "llama-tiny") as (url, _engine):
        _log(f"serving llama-tiny on {url}")
        report = run_serve_bench(url, "chat", "llama-tiny", [1, 4, 16], num_requests=32, max_tokens=32,
                                 show_progress=False)
    errors = sum(r["errors"] for r in report["results"])
    cmd = ("mstar serve llama-tiny --port 8123 &\nmstar bench serve --url http://127.0.0.1:8123 --model llama-tiny "
           "--workload chat --concurrency 1,4,16 --num-requests 32 --max-tokens 32")
    return SuiteResult("serve", cmd, tables=[format_table(report)],
                       goals=[Goal(f"every request answered without an error: {errors} error(s)", errors == 0)],
                       notes=["The server runs in the benchmark's process (uvicorn in a thread), as the soak suite's."],
                       data=report)


def suite_pressure(repeats: int | None) -> SuiteResult:
    from mstar.bench.pressure_bench import format_table, run_pressure_bench

    n = _n(repeats, 3)
    res = run_pressure_bench(32, 4.0, repeats=n, log=_log)
    done = min(r.completed for r in res.runs["pressure"])
    return SuiteResult("pressure", f"mstar bench pressure --repeats {n}", tables=[format_table(res)],
                       goals=[Goal(f"every request completes under pressure, in every repeat: {done}/{res.requests}",
                                   done == res.requests),
                              Goal(f"the same tokens under pressure as with the large cache: "
                                   f"{res.same_tokens}/{res.requests}", res.same_tokens == res.requests)],
                       notes=_fewer(repeats, 3), data=res)


def suite_prefix(repeats: int | None) -> SuiteResult:
    from mstar.bench.prefix_bench import format_table, run_prefix_bench

    n = _n(repeats, 3)
    res = run_prefix_bench(16, 512, (8, 32), 8, n, "tiny", log=_log)
    ttft = res.ratio(lambda r: r.ttft_ms)[0]
    return SuiteResult("prefix", f"mstar bench prefix --repeats {n}", tables=[format_table(res)],
                       goals=[Goal("the same tokens with and without the cache: "
                                   + ("yes" if res.same_tokens else "no"), bool(res.same_tokens)),
                              Goal(f"sequential TTFT p50 lower with the cache: cached / uncached {ttft:.2f}",
                                   ttft < 1.0)],
                       notes=_fewer(repeats, 3), data=res)


def suite_plan(repeats: int | None) -> SuiteResult:
    from mstar.bench.plan_bench import format_tables, goals, run_plan_bench

    res = run_plan_bench(log=_log)
    return SuiteResult("plan", "mstar bench plan", tables=format_tables(res),
                       goals=[Goal(text, ok) for text, ok in goals(res)],
                       notes=["One replay per placement and workload (8 s of seeded Poisson arrivals, longer "
                              "where that gives fewer than 60 requests); the light split one replayed again and "
                              "predicted from a second profile after the rest (the third table: this host's own "
                              "noise); --repeats does not apply."], data=res)


def suite_realtime(repeats: int | None) -> SuiteResult:
    from mstar.bench.realtime_bench import format_table, run_realtime_bench
    from mstar.bench.stats import percentile

    n = _n(repeats, 1)
    res = run_realtime_bench(repeats=n, log=_log)
    one = res.levels[0]
    ratio = percentile(one.chat_ms, 50) / percentile(one.realtime_ms, 50)
    return SuiteResult("realtime", f"mstar bench realtime --repeats {n}", tables=[format_table(res)],
                       goals=[Goal("the warm-up turn answered alike over /v1/realtime and the chat completion: "
                                   + ("yes" if res.same_answer else "no"), res.same_answer),
                              Goal(f"1 session: the end of speech -> first delta p50 lower over /v1/realtime "
                                   f"(prefilled while spoken): chat / realtime {ratio:.2f}", ratio > 1.0)],
                       data=res)


def suite_trace(repeats: int | None) -> SuiteResult:
    from mstar.bench.trace_bench import format_table, run_trace_bench

    n = _n(repeats, 5)
    res = run_trace_bench(repeats=n, log=_log)
    return SuiteResult("trace", f"mstar bench trace --repeats {n}", tables=[format_table(res)],
                       goals=[Goal("the same tokens with and without traces: " + ("yes" if res.same_tokens else "no"),
                                   res.same_tokens),
                              Goal(f"16 concurrent: tok/s with traces within 5% of without: traced / untraced "
                                   f"{res.ratio:.3f}", res.ratio >= 0.95)],
                       notes=_fewer(repeats, 5), data=res)


def suite_sampler(repeats: int | None) -> SuiteResult:
    from mstar.bench.sampler_bench import format_table, goal_lines, run_sampler_bench

    n = _n(repeats, 3)
    res = run_sampler_bench(repeats=n, log=_log)
    return SuiteResult("sampler", f"mstar bench sampler --repeats {n}",
                       description=f"SmolLM2-135M, {res.concurrency} concurrent greedy requests of {res.max_tokens} "
                                   "tokens each, with no sampling option and with presence + frequency penalties, "
                                   "a 50-token logit_bias and top_logprobs 5 on every row, and with every row "
                                   "constrained to a JSON schema (llguidance masks), alternating.",
                       tables=[format_table(res)], goals=goal_lines(res), notes=_fewer(repeats, 3), data=res)


def suite_soak(repeats: int | None) -> SuiteResult:
    from mstar.bench.soak_bench import format_report, soak_in_process

    report = soak_in_process("llama-tiny", "llama-tiny", 2000, 32, log=_log)
    errors = sum(report["errors"].values())
    return SuiteResult("soak", "mstar bench soak --model llama-tiny --requests 2000 --concurrency 32",
                       tables=[format_report(report)],
                       goals=[Goal(f"every request ends the way its kind allows: {errors} error(s)", errors == 0),
                              Goal(f"no resource leaked: {len(report['leaks'])} leak(s)", not report["leaks"])],
                       data=report)


def suite_tp(repeats: int | None) -> SuiteResult:
    from mstar.bench.tp_bench import format_table, run_tp_bench

    n = _n(repeats, 20)
    res = run_tp_bench("bench", 16, 128, n)
    return SuiteResult("tp", f"mstar bench tp --repeats {n}", tables=[format_table(res)],
                       notes=["No goal is set for this suite: it measures what the collectives cost per step "
                              "and per layer; on 2 cores TP2 is not expected to be faster than TP1.",
                              *_fewer(repeats, 20)],
                       data=res)


def suite_transport(repeats: int | None) -> SuiteResult:
    from mstar.bench.transport_bench import format_table, run_transport_bench

    rows = run_transport_bench()
    big = rows[-1]
    share = big.gbps("tcp") / big.gbps("socket")
    return SuiteResult("transport", "mstar bench transport", tables=[format_table(rows)],
                       goals=[Goal(f"tcp path at {big.size >> 20} MB >= 50% of a plain loopback socket's GB/s: "
                                   f"{100 * share:.0f}%", share >= 0.5)],
                       data=[{"size": r.size, "seconds": r.seconds} for r in rows])


# What the engine's kernels were built to give a full decode batch over the PyTorch path (attention and
# plain matmuls): a loss in a kernel's build shows here first, as the kernels compute the same bits
# either way and no parity test can see it.
ENGINE_SPEEDUP, ENGINE_SPEEDUP_BATCH = 3.0, 16


def suite_engine(repeats: int | None) -> SuiteResult:
    from mstar.bench.engine_bench import format_table, run_engine_bench

    n = _n(repeats, 15)
    try:
        rows = run_engine_bench(n)
    except RuntimeError as e:
        return SuiteResult("engine", f"python -m mstar.bench.engine_bench --repeats {n}", skipped=str(e))
    best = {(p, name): b for p, name, b, _ in rows}
    att = "attention, 16 rows x 8 layers"
    goals = [Goal(f"compiled decode attention faster than the PyTorch path (best ms): "
                  f"{best[(att, 'paged_attention, compiled kernel')]:.2f} vs "
                  f"{best[(att, 'paged_attention, PyTorch path')]:.2f}",
                  best[(att, "paged_attention, compiled kernel")] < best[(att, "paged_attention, PyTorch path")])]
    for b in (1, 16):
        probe = f"decode step, batch {b}"
        after, before = (next(v for (p, name), v in best.items() if p == probe and name.startswith(k))
                         for k in ("after", "before"))
        goals.append(Goal(f"decode step at batch {b}, the default path faster than the PyTorch-attention, "
                          f"plain-matmul one (best ms): {after:.2f} vs {before:.2f}", after < before))
        if b == ENGINE_SPEEDUP_BATCH:
            goals.append(Goal(f"decode step at batch {b}, the default path >= {ENGINE_SPEEDUP:.0f}x faster than the "
                              f"PyTorch-attention, plain-matmul one (same run): {before / after:.2f}x",
                              before >= ENGINE_SPEEDUP * after))
    return SuiteResult("engine", f"python -m mstar.bench.engine_bench --repeats {n}", tables=[format_table(rows)],
                       goals=goals, notes=_fewer(repeats, 15), data=rows)


@dataclass(frozen=True)
class Suite:
    title: str  # the section heading in BENCHMARKS.md
    run: Callable[[int | None], SuiteResult]


SUITES: dict[str, Suite] = {
    "llm": Suite("LLM: mstar vs. vLLM CPU and HF transformers", suite_llm),
    "gguf": Suite("GGUF: weights as stored vs. llama.cpp (and vLLM CPU)", suite_gguf),
    "engine": Suite("Engine: compiled attention and the default linears", suite_engine),
    "runtime": Suite("Runtime overhead", suite_runtime),
    "tts": Suite("Orpheus TTS vs. vLLM CPU + SNAC and HF generate", suite_tts),
    "omni": Suite("Qwen3-Omni TTS vs. transformers generate", suite_omni),
    "rollout": Suite("V-JEPA 2-AC rollout vs. the reference predictor", suite_rollout),
    "t2i": Suite("BAGEL: text-to-image vs. the dense oracle loop, image understanding", suite_t2i),
    "policy": Suite("pi0.5 policy over openpi's websocket protocol vs. lerobot", suite_policy),
    "pressure": Suite("KV pressure: 4x oversubscription", suite_pressure),
    "prefix": Suite("Prefix caching: a shared system prompt, on vs. off", suite_prefix),
    "plan": Suite("Placement planner: predicted vs. measured, planned vs. naive goodput", suite_plan),
    "realtime": Suite("Realtime: end of a spoken turn -> first answer delta, /v1/realtime vs. a chat completion",
                      suite_realtime),
    "trace": Suite("Walk traces: tok/s with traces kept vs. none", suite_trace),
    "sampler": Suite("Sampler: OpenAI sampling options on every row vs. none", suite_sampler),
    "serve": Suite("Load generator against a running server", suite_serve),
    "soak": Suite("Soak: mixed load, leaks", suite_soak),
    "tp": Suite("Tensor parallelism: one decode step at TP1 vs TP2", suite_tp),
    "transport": Suite("Transport: one tensor message per path", suite_transport),
}
