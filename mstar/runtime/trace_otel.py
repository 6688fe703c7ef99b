"""Walk traces as OpenTelemetry spans (the ``opentelemetry-sdk`` package: ``pip install mstar[otel]``).

``export_traces(traces, exporter)`` turns request traces (``Runtime.trace``'s list, or the
``requests`` of ``GET /v1/requests/{id}/trace``) into spans with their recorded times and hands them to
any span exporter of the SDK: a console or file exporter (``ConsoleSpanExporter(out=...)``), or an
OTLP one from ``opentelemetry-exporter-otlp`` for a collector. Per request: a span ``request`` (from
its submission to its end) with a child per walk (dispatch to end) and, under each walk, a span per
node run (the batched forward it ran in: its start and compute time), with the rank, iteration,
batch size and queue wait as attributes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export_traces"]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _counts(t: dict[str, Any]) -> dict[str, int]:
    return {f"mstar.{where}.{key}": int(n) for where, keys in (t.get("counts") or {}).items() for key, n in keys.items()}


def export_traces(traces: list[dict[str, Any]], exporter: Any, service_name: str = "mstar") -> int:
    """Export ``traces`` through ``exporter`` (an SDK ``SpanExporter``); returns the spans made.
    ImportError naming the extra when ``opentelemetry-sdk`` is not installed."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    except ImportError as e:
        raise ImportError("OpenTelemetry export needs the opentelemetry-sdk package (pip install 'mstar[otel]')") from e
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("mstar.runtime.trace")
    made = 0
    try:
        for t in traces:
            last = max([t.get("ended") or 0.0] + [w.get("end") or w["start"] for w in t["walks"]]
                       + [r["start"] + r["compute_ms"] / 1e3 for w in t["walks"] for r in w["nodes"]])
            root = tracer.start_span("request", start_time=_ns(t["submitted"]), attributes={
                "mstar.request_id": t["request_id"], "mstar.status": t["status"],
                "mstar.finish_reason": t.get("finish_reason") or "", **_counts(t),
                **{f"mstar.streamed.{k}": n for k, n in (t.get("streamed") or {}).items()}})
            in_request = trace.set_span_in_context(root)
            for w in t["walks"]:
                walk = tracer.start_span(f"walk {w['walk']}", context=in_request, start_time=_ns(w["start"]),
                                         attributes={"mstar.walk": w["walk"], "mstar.partition": w["partition"]})
                in_walk = trace.set_span_in_context(walk)
                for r in w["nodes"]:
                    run = tracer.start_span(r["node"], context=in_walk, start_time=_ns(r["start"]), attributes={
                        "mstar.node": r["node"], "mstar.rank": r["rank"], "mstar.batch": r["batch"],
                        "mstar.iteration": list(r["iteration"]), "mstar.queued_ms": r["queued_ms"]})
                    run.end(end_time=_ns(r["start"] + r["compute_ms"] / 1e3))
                    made += 1
                walk.end(end_time=_ns(w["end"] if w.get("end") is not None else last))
                made += 1
            root.end(end_time=_ns(t["ended"] if t.get("ended") is not None else last))
            made += 1
    finally:
        provider.shutdown()
    return made
