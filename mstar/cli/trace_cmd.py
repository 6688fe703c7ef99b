"""``mstar trace SOURCE``: a request's walk traces, from a running server (``GET
/v1/requests/{id}/trace``) or a file; printed as JSON, or written as OpenTelemetry spans."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="a request's walk traces: JSON, or OpenTelemetry spans",
                       description="Fetch a request's walk traces from a server (by its x-request-id) or read "
                                   "them from a file; print the JSON, or write OpenTelemetry spans (--otel).")
    p.add_argument("source", help="a request id (fetched from --url) or a trace JSON file")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", help="the server's API key, if it has one")
    p.add_argument("--otel", metavar="OUT", help="write OpenTelemetry spans (the SDK's console exporter: one JSON "
                                                "object per span) to OUT, '-' for stdout; needs mstar[otel]")
    p.set_defaults(func=run)


def _fetch(args: argparse.Namespace) -> dict:
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(f"{args.url.rstrip('/')}/v1/requests/{args.source}/trace", headers=headers, timeout=60)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {args.url}: {e}") from e
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise ValueError(f"{args.url}: {r.status_code} {message}")
    return r.json()


def run(args: argparse.Namespace) -> int:
    path = Path(args.source)
    if path.suffix == ".json" and path.is_file():
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: {e}") from e
    else:
        doc = _fetch(args)
    from mstar.runtime.trace import traces_in

    try:
        traces = traces_in(doc)
    except ValueError as e:
        raise ValueError(f"{args.source}: {e}") from None
    if not args.otel:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    from mstar.runtime.trace_otel import export_traces

    try:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    except ImportError as e:
        raise ValueError("--otel needs the opentelemetry-sdk package (pip install 'mstar[otel]')") from e
    out = sys.stdout if args.otel == "-" else open(args.otel, "w")  # noqa: SIM115 - closed below
    try:
        n = export_traces(traces, ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"{n} spans", file=sys.stderr)
    return 0
