"""``mstar graph MODEL --trace``: the walk graph with request traces over it (``trace_to_dot``): the
walks taken bold with their count and time, each node with its runs and iterations, walks not taken
grey; SVG through Graphviz where it is installed; a trace that is not one is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mstar import Runtime
from mstar.graph.render import trace_to_dot
from mstar.models.llama.model import LlamaTiny


@pytest.fixture(scope="module")
def traces():
    with Runtime(LlamaTiny()) as rt:
        rt.submit({"input_ids": torch.tensor([5, 6, 7])}, {"max_tokens": 4, "sampling": {"ignore_eos": True}},
                  request_id="long").result()
        rt.submit({"input_ids": torch.tensor([5, 6, 8])}, {"max_tokens": 1}, request_id="short").result()
        return {"long": rt.trace("long"), "short": rt.trace("short"), "graph": rt.model.graph}


def test_the_walks_taken_carry_their_runs(traces):
    dot = trace_to_dot(traces["graph"], traces["long"])
    assert '"prefill: 1x' in dot and '"decode: 1x' in dot
    # the decode loop: 4 forwards (the stop flag read one iteration late), 4 distinct iterations
    assert "LLM\\n4 runs, 4 iterations" in dot
    assert 'style=dotted, color=blue, label="then"' in dot  # prefill, then decode
    one_token = trace_to_dot(traces["graph"], traces["short"])
    assert '"decode (not taken)"' in one_token and '"prefill: 1x' in one_token


def test_the_cli_draws_a_trace_file(traces, tmp_path, capsys):
    from mstar.cli.main import main

    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"object": "request.trace", "id": "long", "requests": traces["long"]}))
    out = tmp_path / "trace.dot"
    assert main(["graph", "llama-tiny", "--trace", str(path), "-o", str(out)]) == 0
    assert out.read_text().startswith("digraph trace {")
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed (apt-get install graphviz; `make test` does it where apt is)")
    svg = tmp_path / "trace.svg"
    assert main(["graph", "llama-tiny", "--trace", str(path), "--format", "svg", "-o", str(svg)]) == 0
    assert "<svg" in svg.read_text() and "decode: 1x" in svg.read_text()


@pytest.mark.parametrize("content,fragment", [
    ("{not json", "Expecting property name"),
    ('{"requests": [{"no": "walks"}]}', "requests with walks"),
    ('{"walks": [{"walk": "image_gen", "partition": "x", "nodes": []}]}', "are not this model's"),
])
def test_a_bad_trace_file_is_refused(tmp_path, capsys, content, fragment):
    from mstar.cli.main import main

    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["graph", "llama-tiny", "--trace", str(path)]) == 2
    assert fragment in capsys.readouterr().err
