"""``mstar plan MODEL --ranks N --workload W.yaml --slo '...'``: the cheapest placement meeting an SLO.

Profiles the model on this machine with the real runtime (or reads a saved profile), simulates every
candidate placement on the workload's arrivals and prints the chosen placement YAML with its
predicted figures and why it was chosen (``mstar.planner``; README, "Planning a placement").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the cheapest placement meeting an SLO under a workload",
                       description="Profile MODEL on this machine (or read --from-profile), simulate candidate "
                                   "placements over up to --ranks ranks on the workload's arrivals, and print the "
                                   "cheapest placement YAML whose predicted percentiles meet --slo.")
    p.add_argument("model", help="a registered model name (`mstar models`) or module:Class")
    p.add_argument("--ranks", type=int, required=True, help="the most ranks (worker processes) the plan may use")
    p.add_argument("--workload", required=True, metavar="W.yaml", help="the workload (arrival rate, request classes)")
    p.add_argument("--slo", required=True, help="objectives, e.g. 'ttft_p95<=500ms,tpot_p95<=50ms'")
    p.add_argument("--profile", metavar="OUT.json", help="write the profile measured here to OUT.json")
    p.add_argument("--from-profile", metavar="IN.json", help="use a saved profile instead of profiling")
    p.add_argument("--out", metavar="PLAN.yaml", help="write the placement YAML there (default: print it)")
    p.add_argument("--max-batch", type=int, default=16, help="max_batch_size of the profiled and planned ranks")
    p.add_argument("--workers", choices=["process", "inline"], default="process",
                   help="how the profile runs the runtime (default: worker processes, as `mstar serve`)")
    p.add_argument("--no-tensor-parallel", dest="tensor_parallel", action="store_false",
                   help="do not profile or plan tensor parallelism")
    p.add_argument("--model-path", help="checkpoint directory of the model")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.set_defaults(func=run)


def _model(args: argparse.Namespace):
    from mstar.cli.serve_cmd import model_kwargs
    from mstar.model.registry import import_target, registered_models, resolve_model

    registry = registered_models()
    target = import_target(registry[args.model]) if args.model in registry else (
        import_target(args.model) if ":" in args.model else None)
    if target is None:
        raise ValueError(f"unknown model {args.model!r}; registered: {', '.join(registry)}")
    return resolve_model(args.model, **model_kwargs(target, args))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def report(result, slo, ranks: int) -> str:
    """The plan as text: what was chosen and why, every candidate's predicted figures."""
    c, lines = result.chosen, []
    if result.feasible:
        lines.append(f"plan: {c.candidate.name} ({c.candidate.ranks_used} of {ranks} ranks)")
        cheaper = [e for e in result.evaluated if e.candidate.ranks_used < c.candidate.ranks_used]
        why = "it is the cheapest candidate meeting every objective"
        if cheaper:
            why += f"; {len(cheaper)} candidate(s) on fewer ranks miss " + ", ".join(sorted(
                {str(v.objective) for e in cheaper for v in e.verdicts if not v.met}))
        lines.append(f"why: {why}, goodput {c.goodput:.2f} req/s predicted")
    else:
        lines.append(f"no placement over {ranks} ranks meets {slo}; the best achievable is {c.candidate.name}, "
                     f"goodput {c.goodput:.2f} req/s:")
        for e in _best_values(result):
            lines.append(f"  {e}")
    lines.append("")
    lines.append("| candidate | ranks | " + " | ".join(str(o) for o in slo.objectives) + " | goodput req/s | meets |")
    lines.append("|---|---:|" + "---:|" * len(slo.objectives) + "---:|---|")
    for e in result.evaluated:
        cells = " | ".join(_ms(v.value_s) for v in e.verdicts)
        lines.append(f"| {e.candidate.name} | {e.candidate.ranks_used} | {cells} | {e.goodput:.2f} | "
                     f"{'yes' if e.met else 'no'} |")
    return "\n".join(lines)


def _best_values(result) -> list[str]:
    """Per objective, the best any candidate reached."""
    out = []
    for i, v in enumerate(result.chosen.verdicts):
        values = [e.verdicts[i].value_s for e in result.evaluated if e.verdicts[i].value_s is not None]
        best = min(values) if values else None
        out.append(f"{v.objective}: best predicted {_ms(best)} (limit {v.objective.limit_s * 1e3:g} ms)")
    return out


def placement_yaml(result, model: str, max_batch: int, slo) -> str:
    import yaml

    c = result.chosen
    head = [f"# mstar plan: {c.candidate.name}",
            "# predicted under the workload: " + ", ".join(f"{v.objective.metric}_p{v.objective.percentile:g} "
                                                          f"{_ms(v.value_s)}" for v in c.verdicts),
            f"# SLO {slo}: {'met' if result.feasible else 'NOT met (best achievable)'}"]
    body = yaml.safe_dump(c.candidate.placement_dict(model, max_batch), sort_keys=False, default_flow_style=None)
    return "\n".join(head) + "\n" + body


def run(args: argparse.Namespace) -> int:
    from mstar.planner import load_workload, parse_slo
    from mstar.planner.profile import Profile
    from mstar.planner.profiling import profile_model
    from mstar.planner.search import plan

    if args.ranks < 1:
        raise ValueError("--ranks must be >= 1")
    workload, slo = load_workload(args.workload), parse_slo(args.slo)
    model = _model(args)
    if args.from_profile:
        profile = Profile.load(args.from_profile)
        if profile.model != model.name:
            raise ValueError(f"{args.from_profile} profiles {profile.model!r}, not {model.name!r}")
    else:
        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        profile = profile_model(model, workload, args.ranks, max_batch=args.max_batch, workers=args.workers,
                                tensor_parallel=args.tensor_parallel, say=say)
    if args.profile:
        profile.save(args.profile)
    result = plan(model, profile, workload, slo, args.ranks)
    text = placement_yaml(result, model.name, profile.max_batch, slo)
    if args.out:
        Path(args.out).write_text(text)
    print(report(result, slo, args.ranks))
    print()
    print(text if not args.out else f"placement written to {args.out}")
    return 0 if result.feasible else 1
