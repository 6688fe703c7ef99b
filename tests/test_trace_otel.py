"""Walk traces as OpenTelemetry spans (``mstar.runtime.trace_otel``, the SDK's exporters): a request
span, a child per walk, a grandchild per node run, with the recorded times and attributes; ``mstar
trace FILE --otel OUT`` writes them through the SDK's console exporter."""

from __future__ import annotations

import json

import pytest
import torch

from mstar import Runtime
from mstar.models.llama.model import LlamaTiny
from mstar.runtime.trace_otel import export_traces

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed (pip install 'mstar[otel]')")


@pytest.fixture(scope="module")
def traces():
    with Runtime(LlamaTiny()) as rt:
        rt.submit({"input_ids": torch.tensor([5, 6, 7])}, {"max_tokens": 3, "sampling": {"ignore_eos": True}},
                  request_id="otel").result()
        return rt.trace("otel")


def test_a_trace_becomes_a_request_span_with_walk_and_node_run_children(traces):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    made = export_traces(traces, exporter)
    spans = exporter.get_finished_spans()
    assert made == len(spans) == 1 + 2 + 1 + 3  # the request, its 2 walks, 1 prefill run, 3 decode runs
    by_id = {s.context.span_id: s for s in spans}
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "request" and root.attributes["mstar.request_id"] == traces[0]["request_id"]
    walks = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert [w.name for w in sorted(walks, key=lambda s: s.start_time)] == ["walk prefill", "walk decode"]
    runs = [s for s in spans if s.name == "LLM"]
    for run in runs:
        walk = by_id[run.parent.span_id]
        assert walk.name.startswith("walk ") and walk.start_time <= run.start_time <= run.end_time
        assert run.attributes["mstar.rank"] == 0 and run.attributes["mstar.batch"] == 1
    assert root.start_time <= min(s.start_time for s in spans) and root.end_time >= max(s.end_time for s in spans)
    assert all(s.context.trace_id == root.context.trace_id for s in spans)


def test_the_cli_writes_spans_from_a_trace_file(traces, tmp_path, capsys):
    from mstar.cli.main import main

    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"object": "request.trace", "id": "otel", "requests": traces}))
    out = tmp_path / "spans.jsonl"
    assert main(["trace", str(path), "--otel", str(out)]) == 0
    spans = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(spans) == 7 and {s["name"] for s in spans} == {"request", "walk prefill", "walk decode", "LLM"}
    assert main(["trace", str(path)]) == 0 and json.loads(capsys.readouterr().out)["id"] == "otel"
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [{"no": "walks"}]}')
    assert main(["trace", str(bad)]) == 2 and "not a walk trace" in capsys.readouterr().err
