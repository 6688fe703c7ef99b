"""``mstar graph MODEL``: print a model's compiled walks or draw one with Graphviz."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graph", help="describe a model's walks, or draw one (DOT, SVG, PNG)",
                       description="Describe a model's compiled walks, or draw one walk.")
    p.add_argument("model", help="registered model name or module:Class")
    p.add_argument("--walk", help="walk to draw (default: describe every walk as text)")
    p.add_argument("--format", choices=["text", "dot", "svg", "png"], default=None,
                   help="output format (default: text, or dot when --walk is given)")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mstar.model.registry import resolve_model

    graph = resolve_model(args.model).graph
    fmt = args.format or ("dot" if args.walk else "text")
    if fmt == "text":
        out: str | bytes = graph.describe(args.walk) + "\n"
    else:
        if not args.walk:
            raise ValueError(f"--format {fmt} draws one walk: pass --walk (walks: {', '.join(graph.plans)})")
        out = graph.to_dot(args.walk)
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
