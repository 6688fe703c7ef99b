"""The ``mstar`` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar", description="Serving runtime for composite multimodal models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from mstar.cli import bench_cmd, graph_cmd, plan_cmd, serve_cmd, trace_cmd

    serve_cmd.add_parser(sub)
    graph_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    models = sub.add_parser("models", help="list the registered models")
    models.set_defaults(func=_list_models)
    return parser


def _list_models(args: argparse.Namespace) -> int:
    from mstar.model.registry import registered_models

    for name, target in registered_models().items():
        print(f"{name:20s} {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
