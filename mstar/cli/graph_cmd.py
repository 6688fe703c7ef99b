"""``mstar graph MODEL``: print a model's compiled walks or draw one with Graphviz."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graph", help="describe a model's walks, or draw one (DOT, SVG, PNG)",
                       description="Describe a model's compiled walks, or draw one walk.")
    p.add_argument("model", help="registered model name or module:Class")
    p.add_argument("--walk", help="walk to draw (default: describe every walk as text)")
    p.add_argument("--trace", metavar="JSON",
                   help="draw the whole graph with a request trace over it: the JSON of GET /v1/requests/{id}/trace "
                        "(or Runtime.trace's list, or one request's trace)")
    p.add_argument("--format", choices=["text", "dot", "svg", "png"], default=None,
                   help="output format (default: text, or dot when --walk or --trace is given)")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=run)


def _traces(path: str, graph) -> list[dict]:
    """The request traces in ``path``: the trace endpoint's JSON, a list of traces, or one trace;
    ValueError when it is none of those or names walks ``graph`` does not have."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--trace {path}: {e}") from e
    from mstar.runtime.trace import traces_in

    try:
        traces = traces_in(doc)
    except ValueError as e:
        raise ValueError(f"--trace {path}: {e}") from None
    unknown = sorted({w.get("walk") for t in traces for w in t["walks"]} - set(graph.plans))
    if unknown:
        raise ValueError(f"--trace {path}: walks {unknown} are not this model's (walks: {', '.join(graph.plans)})")
    return traces


def run(args: argparse.Namespace) -> int:
    from mstar.graph.render import trace_to_dot
    from mstar.model.registry import resolve_model

    graph = resolve_model(args.model).graph
    fmt = args.format or ("dot" if args.walk or args.trace else "text")
    if args.trace and (args.walk or fmt == "text"):
        raise ValueError("--trace draws the whole graph: give it without --walk, with --format dot, svg or png")
    if fmt == "text":
        out: str | bytes = graph.describe(args.walk) + "\n"
    else:
        if not args.walk and not args.trace:
            raise ValueError(f"--format {fmt} draws one walk: pass --walk (walks: {', '.join(graph.plans)}), "
                             "or --trace")
        out = trace_to_dot(graph, _traces(args.trace, graph)) if args.trace else graph.to_dot(args.walk)
        if fmt in ("svg", "png"):
            dot = shutil.which("dot")
            if dot is None:
                raise ValueError(f"--format {fmt} needs Graphviz's `dot`, which is not installed "
                                 f"(Debian: apt-get install graphviz); --format dot works without it")
            if fmt == "png" and not args.output:
                raise ValueError("--format png writes binary data: pass -o FILE")
            out = subprocess.run([dot, f"-T{fmt}"], input=out.encode(), capture_output=True, check=True).stdout
    if args.output:
        mode = "wb" if isinstance(out, bytes) else "w"
        with open(args.output, mode) as f:
            f.write(out)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(out if isinstance(out, str) else out.decode())
    return 0
