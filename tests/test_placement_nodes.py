"""The ``nodes:`` section of a placement file: logical hosts and their ranks."""

import pytest

from mstar.placement import ClusterNode, Placement, PlacementError
from tests.toy_models import ToyLM

GROUPS = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
          {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]


def _placement(nodes):
    return Placement.from_dict({"model": "toy-lm", "nodes": nodes, "node_groups": GROUPS})


def test_nodes_parse_validate_and_round_trip():
    p = _placement([{"name": "a", "ranks": [0]}, {"name": "b", "ranks": [1]}]).validate(ToyLM().graph)
    assert p.cluster_nodes == (ClusterNode("a", (0,)), ClusterNode("b", (1,)))
    assert [p.cluster_node_of(r) for r in (0, 1, 2)] == ["a", "b", None]
    again = Placement.from_dict(p.to_dict())
    assert again.cluster_nodes == p.cluster_nodes
    assert Placement.from_dict({"node_groups": GROUPS}).cluster_nodes == ()


@pytest.mark.parametrize("nodes, message", [
    ([{"name": "a", "ranks": [0]}, {"name": "a", "ranks": [1]}], "'a' used more than once"),
    ([{"name": "a", "ranks": [0, 1]}, {"name": "b", "ranks": [1]}], "rank 1 is on both 'a' and 'b'"),
    ([{"name": "a", "ranks": [0]}], r"rank\(s\) \[1\] on no node"),
    ([{"name": "a", "ranks": [0, 1, 2]}], r"rank\(s\) \[2\] are used by no node group"),
    ([{"name": "a", "ranks": [0, 1], "ip": "10.0.0.1"}], "unknown key"),
    ([{"name": "", "ranks": [0, 1]}], "name must be a non-empty string"),
    ([{"name": "a", "ranks": []}], "ranks must be a non-empty list"),
    ({"a": [0, 1]}, "nodes must be a non-empty list"),
])
def test_bad_nodes_sections_are_rejected_clearly(nodes, message):
    with pytest.raises(PlacementError, match=message):
        _placement(nodes).validate(ToyLM().graph)
