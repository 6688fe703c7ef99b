"""Malformed declarations are rejected at construction, with the walk, node and edge named."""

import pytest

from mstar.graph import (
    EMIT_TO_CLIENT,
    Connection,
    DynamicLoop,
    FixedChunkPolicy,
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


def N(name, inputs=(), outputs=()):  # noqa: N802 - reads like the declaration it builds
    return GraphNode(name=name, input_names=list(inputs), outputs=list(outputs))


def E(dest, name):  # noqa: N802
    return GraphEdge(next_node=dest, name=name)


def rejects(match, walks, **kw):
    with pytest.raises(ValueError, match=match):
        WalkGraph(walks, **kw)


def test_edge_to_unknown_node():
    rejects(r"walk 'w': node 'a', edge 'x' targets unknown node 'b'",
            [Walk("w", N("a", ["i"], [E("b", "x")]), inputs=["i"])])


def test_edge_to_node_of_another_walk():
    rejects(r"walk 'w1': node 'a', edge 'x' targets node 'b', which is not part of this walk",
            [Walk("w1", N("a", ["i"], [E("b", "x")]), inputs=["i"]), Walk("w2", N("b", ["x"]), inputs=["x"])])


def test_edge_to_missing_input_name():
    rejects(r"walk 'w': node 'a', edge 'y' targets 'b', which has no input named 'y'",
            [Walk("w", Sequential([N("a", ["i"], [E("b", "y")]), N("b", ["x"])]), inputs=["i"])])


def test_input_produced_by_nothing():
    rejects(r"walk 'w': node 'b', input 'z' is produced by nothing in the walk",
            [Walk("w", Sequential([N("a", ["i"], [E("b", "x")]), N("b", ["x", "z"])]), inputs=["i"])])


def test_two_parallel_branches_write_same_join_input():
    sec = Sequential([Parallel([N("a", ["i"], [E("j", "x")]), N("b", ["i"], [E("j", "x")])]), N("j", ["x"])])
    rejects(r"walk 'w': node 'j', input 'x': two Parallel branches write the same input of join node 'j'",
            [Walk("w", sec, inputs=["i"])])


def test_loop_with_no_bound():
    with pytest.raises(ValueError, match=r"loop 'a_loop' has no bound"):
        Loop(section=N("a", ["x"], [E("a", "x")]))
    with pytest.raises(ValueError, match=r"loop 'a_loop' has no bound"):
        DynamicLoop(section=N("a", ["x"], [E("a", "x")]), max_iters=0)


def test_feedback_edge_leaving_its_loop():
    sec = Sequential([Loop(N("a", ["x"], [E("a", "x"), E("b", "x")]), max_iters=3), N("b", ["x"])])
    rejects(r"walk 'w': node 'a', edge 'x' leaves loop 'a_loop' directly to 'b'", [Walk("w", sec, inputs=["x"])])


def test_backward_edge_outside_loop():
    sec = Sequential([N("a", ["i", "y"], [E("b", "x")]), N("b", ["x"], [E("a", "y")])])
    rejects(r"walk 'w': node 'b', edge 'y' goes backwards to 'a' outside any loop", [Walk("w", sec, inputs=["i"])])


def test_streaming_edge_between_unconnected_partitions():
    walks = [Walk("p", N("a", ["i"], [StreamingGraphEdge("c", "tok", target_partition="B")]), inputs=["i"],
                  partition="A"),
             Walk("q", N("c", ["tok"]), partition="B")]
    rejects(r"walk 'p': node 'a', streaming edge 'tok': partitions 'A' and 'B' are not connected", walks)


def test_streaming_edge_to_unknown_partition():
    walks = [Walk("p", N("a", ["i"], [StreamingGraphEdge("c", "tok", target_partition="Z")]), inputs=["i"])]
    rejects(r"walk 'p': node 'a', streaming edge 'tok' targets unknown partition 'Z'", walks)


def test_unused_connection():
    walks = [Walk("p", N("a", ["i"]), inputs=["i"], partition="A"), Walk("q", N("c", ["i"]), inputs=["i"],
                                                                        partition="B")]
    topo = PartitionTopology([Connection("A", "B", "tok", lambda: FixedChunkPolicy(1))])
    rejects(r"Connection 'tok' \(A -> B\) is used by no StreamingGraphEdge", walks, topology=topo)


def test_partition_cycle():
    walks = [Walk("p", N("a", ["i", "y"], [StreamingGraphEdge("b", "x", target_partition="B")]), inputs=["i"],
                  partition="A"),
             Walk("q", N("b", ["x"], [StreamingGraphEdge("a", "y", target_partition="A")]), partition="B")]
    topo = PartitionTopology([Connection("A", "B", "x", lambda: FixedChunkPolicy(1)),
                              Connection("B", "A", "y", lambda: FixedChunkPolicy(1))])
    rejects(r"partition streams form a cycle: A -> B -> A", walks, topology=topo)


def test_duplicate_node_in_walk():
    rejects(r"walk 'w': node 'a' appears twice",
            [Walk("w", Sequential([N("a", ["i"], [E("b", "x")]), N("b", ["x"]), N("a", ["i"])]), inputs=["i"])])


def test_duplicate_walk_and_loop_names():
    rejects(r"duplicate walk name 'w'", [Walk("w", N("a", ["i"]), inputs=["i"]),
                                         Walk("w", N("a", ["i"]), inputs=["i"])])
    sec = Sequential([Loop(N("a", ["x"], [E("a", "x")]), max_iters=2, name="L"),
                      Loop(N("b", ["x"], [E("b", "x")]), max_iters=2, name="L")])
    rejects(r"walk 'w': two loops are named 'L'", [Walk("w", sec, inputs=["x"])])


def test_duplicate_inputs_and_edges():
    with pytest.raises(ValueError, match=r"node 'a' lists input 'x' twice"):
        N("a", ["x", "x"])
    with pytest.raises(ValueError, match=r"node 'a' declares edge 'x' to 'b' twice"):
        N("a", [], [E("b", "x"), E("b", "x")])


def test_unreachable_node():
    rejects(r"nodes \['ghost'\] are unreachable: no walk uses them",
            [Walk("w", N("a", ["i"]), inputs=["i"])], nodes=["a", "ghost"])


def test_feedback_without_first_iteration_value():
    sec = Loop(N("a", ["x"], [E("a", "x")]), max_iters=4)
    rejects(r"walk 'w': node 'a', input 'x' is fed back by a but nothing provides its first iteration",
            [Walk("w", sec)])


def test_edge_between_parallel_branches():
    sec = Sequential([Parallel([N("a", ["i"], [E("b", "x")]), N("b", ["x"])])])
    rejects(r"walk 'w': node 'a', edge 'x' goes from one Parallel branch to another \('b'\)",
            [Walk("w", sec, inputs=["i"])])


def test_loop_output_not_produced_in_body():
    sec = Sequential([Loop(N("a", ["x"], [E("a", "x")]), max_iters=2, outputs=[E("b", "y")]), N("b", ["y"])])
    rejects(r"walk 'w': loop 'a_loop', output 'y' is produced by no node of the loop's body",
            [Walk("w", sec, inputs=["x"])])


def test_unused_walk_input_and_typo():
    rejects(r"walk 'w': declared inputs \['ids_typo'\] are consumed by no node",
            [Walk("w", N("a", ["ids"]), inputs=["ids", "ids_typo"])])


def test_dynamic_loop_stop_node_must_be_named():
    with pytest.raises(ValueError, match=r"dynamic loop 'a_loop' has several body nodes"):
        DynamicLoop(Sequential([N("a", ["x"], [E("b", "y")]), N("b", ["y"], [E("a", "x")])]), max_iters=3)
    with pytest.raises(ValueError, match=r"stop_node 'zz' is not in its body"):
        DynamicLoop(N("a", ["x"], [E("a", "x")]), max_iters=3, stop_node="zz")


def test_bad_edge_and_node_fields():
    with pytest.raises(ValueError, match=r"output_modality only applies to edges to EMIT_TO_CLIENT"):
        GraphEdge("a", "x", output_modality="audio")
    with pytest.raises(ValueError, match=r"reserved"):
        N(EMIT_TO_CLIENT)
    with pytest.raises(ValueError, match=r"Sequential needs at least one section"):
        Sequential([])
