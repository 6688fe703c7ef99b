"""WalkTracker alone: compiled plans fed fake node outputs (plain ints), no torch, no workers.

Each test drives the tracker as a worker would (start, then node_done for every ready node) and
checks the Effects it returns: which node instances became ready with which inputs, what was
emitted, kept on the request, pushed to another partition, and when the walk ended.
"""

import pytest

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    Connection,
    DynamicLoop,
    FinishReason,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    PartitionTopology,
    Sequential,
    StreamingGraphEdge,
    Walk,
    WalkGraph,
)
from mstar.graph.chunking import Chunk, FixedChunkPolicy
from mstar.runtime.walk_tracker import Effects, WalkTracker, read_stop


def plan(section, inputs, **walk):
    return WalkGraph([Walk("w", section, inputs=inputs, **walk)]).plan("w")


def only(fx: Effects):
    assert len(fx.ready) == 1, fx.ready
    return fx.ready[0]


def test_sequential_routes_local_emit_and_state():
    p = plan(Sequential([GraphNode("a", ["x"], [GraphEdge("b", "h"), GraphEdge(TO_STATE, "h")]),
                         GraphNode("b", ["h"], [GraphEdge(EMIT_TO_CLIENT, "y", output_modality="text")])]), ["x"])
    t = WalkTracker(p, {"x": 1})
    a = only(t.start())
    assert (a.node, a.iteration, a.inputs) == ("a", (), {"x": 1})
    fx = t.node_done("a", (), {"h": 2})
    assert fx.state == {"h": 2} and not fx.emits and not fx.done
    b = only(fx)
    assert (b.node, b.inputs) == ("b", {"h": 2})
    fx = t.node_done("b", (), {"y": 3})
    assert [(e.name, e.value, e.modality, e.node) for e in fx.emits] == [("y", 3, "text", "b")]
    assert fx.done and not fx.ready


def test_empty_list_emit_is_nothing():
    p = plan(GraphNode("a", ["x"], [GraphEdge(EMIT_TO_CLIENT, "y")]), ["x"])
    t = WalkTracker(p, {"x": 1})
    t.start()
    fx = t.node_done("a", (), {"y": []})
    assert fx.emits == [] and fx.done


def test_static_loop_feeds_back_then_exits():
    loop = Loop(GraphNode("n", ["x"], [GraphEdge("n", "x")]), max_iters=3, outputs=[GraphEdge("after", "x")])
    p = plan(Sequential([loop, GraphNode("after", ["x"], [GraphEdge(EMIT_TO_CLIENT, "x")])]), ["x"])
    t = WalkTracker(p, {"x": 0})
    r = only(t.start())
    seen = []
    while r.node == "n":
        seen.append((r.iteration, r.inputs["x"]))
        r = only(t.node_done("n", r.iteration, {"x": r.inputs["x"] + 1}))
    assert seen == [((0,), 0), ((1,), 1), ((2,), 2)]
    assert (r.node, r.iteration, r.inputs) == ("after", (), {"x": 3})
    assert t.node_done("after", (), {"x": 3}).done


def test_dynamic_loop_stops_after_the_iteration_that_says_so():
    loop = DynamicLoop(GraphNode("n", ["x"], [GraphEdge("n", "x"), GraphEdge(EMIT_TO_CLIENT, "x")]), max_iters=10)
    t = WalkTracker(plan(loop, ["x"]), {"x": 0})
    r = only(t.start())
    emitted = []
    for i in range(3):
        fx = t.node_done("n", r.iteration, {"x": i, "stop": i == 2})
        emitted += [e.value for e in fx.emits]
        if i < 2:
            r = only(fx)
    assert emitted == [0, 1, 2] and fx.done and not fx.ready


def test_deferred_stop_discards_the_speculative_iteration():
    loop = DynamicLoop(GraphNode("n", ["x"], [GraphEdge("n", "x"), GraphEdge(EMIT_TO_CLIENT, "x")]),
                       max_iters=10, defer_stop_check=True)
    t = WalkTracker(plan(loop, ["x"]), {"x": 0})
    r0 = only(t.start())
    r1 = only(t.node_done("n", r0.iteration, {"x": 1, "stop": True}))  # next iteration starts before the check
    assert r1.iteration == (1,)
    fx = t.node_done("n", r1.iteration, {"x": 2, "stop": False})
    assert fx.emits == [] and fx.done  # iteration 1 ran past the stop: dropped whole


def test_a_walk_ends_with_the_reason_its_stop_flag_carries_or_length_at_the_bound():
    def run(stop_at, flag, defer):
        loop = DynamicLoop(GraphNode("n", ["x"], [GraphEdge("n", "x")]), max_iters=4, defer_stop_check=defer)
        t = WalkTracker(plan(loop, ["x"]), {"x": 0})
        r, i = only(t.start()), 0
        while True:
            fx = t.node_done("n", r.iteration, {"x": i, "stop": flag if i == stop_at else None})
            if fx.done:
                return t.finish, i
            r, i = only(fx), i + 1

    for defer in (False, True):
        ran_past = int(defer)  # a deferred check runs one speculative iteration past the stop
        assert run(1, FinishReason.STOP, defer) == (FinishReason.STOP, 1 + ran_past)
        assert run(0, [FinishReason.LENGTH], defer) == (FinishReason.LENGTH, ran_past)
        assert run(1, True, defer) == (None, 1 + ran_past)  # a plain flag says no reason
        assert run(9, FinishReason.STOP, defer) == (FinishReason.LENGTH, 3)  # never raised: the bound


def test_parallel_branches_join():
    body = Sequential([Parallel([GraphNode("a", ["x"], [GraphEdge("j", "u")]),
                                 GraphNode("b", ["x"], [GraphEdge("j", "v")])]),
                       GraphNode("j", ["u", "v"], [GraphEdge(EMIT_TO_CLIENT, "y")])])
    p = plan(body, ["x"])
    assert p.join_nodes == ("j",)
    t = WalkTracker(p, {"x": 5})
    assert sorted(r.node for r in t.start().ready) == ["a", "b"]
    assert t.node_done("b", (), {"v": 2}).ready == []  # waits for the other branch
    j = only(t.node_done("a", (), {"u": 1}))
    assert (j.node, j.inputs) == ("j", {"u": 1, "v": 2})


def test_nested_loop_enters_with_outer_values_and_accumulates_its_exit():
    inner = Loop(GraphNode("p", ["h", "c"], [GraphEdge("p", "c")]), max_iters=2,
                 outputs=[GraphEdge("asm", "c")], accumulate=["c"], name="inner")
    body = Sequential([GraphNode("t", ["f"], [GraphEdge("p", "h"), GraphEdge("p", "c"), GraphEdge("asm", "c0")]),
                       inner,
                       GraphNode("asm", ["c0", "c"], [GraphEdge("t", "f"), GraphEdge(EMIT_TO_CLIENT, "frame")])])
    p = plan(Loop(body, max_iters=2, name="outer"), ["f"])
    assert {(r.dest, r.loop) for r in p.nodes["t"].routes if r.kind.value == "enter"} == {("p", "inner")}
    t = WalkTracker(p, {"f": 0})
    r = only(t.start())
    frames = []
    for outer_it in range(2):
        assert (r.node, r.iteration) == ("t", (outer_it,))
        r = only(t.node_done("t", r.iteration, {"h": 10 * outer_it, "c": 0, "c0": 100 + outer_it}))
        for inner_it in range(2):
            assert (r.node, r.iteration, r.inputs["h"]) == ("p", (outer_it, inner_it), 10 * outer_it)
            r = only(t.node_done("p", r.iteration, {"c": r.inputs["c"] + 1}))
        assert (r.node, r.inputs) == ("asm", {"c0": 100 + outer_it, "c": [1, 2]})
        fx = t.node_done("asm", r.iteration, {"f": outer_it + 1, "frame": outer_it})
        frames += [e.value for e in fx.emits]
        if outer_it == 0:
            r = only(fx)
    assert frames == [0, 1] and fx.done


class FakeStreams:
    def __init__(self):
        self.chunks = {}

    def pull(self, node, name):
        q = self.chunks.get((node, name))
        return q.pop(0) if q else None


def two_partitions():
    prod = Loop(GraphNode("gen", ["x"], [GraphEdge("gen", "x"), StreamingGraphEdge("sink", "item", target_partition="B")]),
                max_iters=2)
    topo = PartitionTopology([Connection("A", "B", "item", lambda: FixedChunkPolicy(chunk_size=1))])
    return WalkGraph([Walk("make", prod, inputs=["x"], partition="A"),
                      Walk("take", GraphNode("sink", ["item"], [GraphEdge(EMIT_TO_CLIENT, "got")]), partition="B")],
                     topology=topo)


def test_stream_pushes_are_effects():
    t = WalkTracker(two_partitions().plan("make"), {"x": 0})
    r = only(t.start())
    fx = t.node_done("gen", r.iteration, {"x": 1, "item": [7]})
    assert [(q.partition, q.node, q.name, q.items) for q in fx.pushes] == [("B", "sink", "item", [7])]


def test_stream_input_waits_for_a_chunk():
    streams = FakeStreams()
    t = WalkTracker(two_partitions().plan("take"), {}, streams)
    assert t.start().ready == [] and t.waiting_on_stream
    assert t.stream_ready().ready == []  # still nothing
    streams.chunks[("sink", "item")] = [Chunk((7, 8), 0, 0, False)]
    r = only(t.stream_ready())
    assert (r.node, r.inputs["item"], r.stream_chunks["item"].start) == ("sink", [7, 8], 0)
    assert not t.waiting_on_stream


def test_protocol_errors_are_clear():
    t = WalkTracker(plan(GraphNode("a", ["x"], [GraphEdge(EMIT_TO_CLIENT, "y")]), ["x"]), {"x": 1})
    with pytest.raises(RuntimeError, match="not running"):
        t.node_done("a", (), {"y": 1})
    t.start()
    with pytest.raises(ValueError, match="returned no output 'y'"):
        t.node_done("a", (), {"z": 1})
    with pytest.raises(ValueError, match="needs inputs"):
        WalkTracker(t.plan, {})


def test_read_stop():
    import torch

    assert read_stop(True) and not read_stop(False)
    assert read_stop([True, True]) and not read_stop([True, False]) and not read_stop([])
    # one flag as a 0-d tensor (what the LLM node returns per request), and tensors of flags
    assert read_stop(torch.tensor(True)) and not read_stop(torch.tensor(False))
    assert read_stop(torch.tensor(1)) and not read_stop(torch.tensor(0.0))
    assert read_stop(torch.tensor([True, True])) and not read_stop(torch.tensor([True, False]))
    assert not read_stop(torch.zeros(0, dtype=torch.bool))
    assert read_stop([torch.tensor(True), True]) and not read_stop([torch.tensor(False), True])
