"""The Ray driver's plan without Ray: bundles from a placement's nodes: section, and the message
naming what a cluster lacks when the placement group cannot be placed."""

from mstar.placement import Placement
from mstar.runtime.drivers.ray import Bundle, missing_resources, plan_bundles
from mstar.runtime.routing import Routing
from tests.toy_models import ToyLM

GROUPS = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
          {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]


def _routing(nodes=None) -> Routing:
    d = {"model": "toy-lm", "node_groups": GROUPS, **({"nodes": nodes} if nodes else {})}
    model = ToyLM()
    return Routing(model.graph, Placement.from_dict(d).validate(model.graph))


def test_one_bundle_per_node_pinned_where_the_cluster_has_the_resource():
    routing = _routing([{"name": "a", "ranks": [0]}, {"name": "b", "ranks": [1]}])
    bundles = plan_bundles(routing, "cpu", {"CPU": 4.0, "mstar_node_a": 1.0})
    assert bundles == [Bundle("a", (0,), {"CPU": 1.0, "mstar_node_a": 0.001}), Bundle("b", (1,), {"CPU": 1.0})]
    gpu = plan_bundles(routing, "cuda", {})
    assert [b.resources for b in gpu] == [{"GPU": 1.0, "CPU": 1.0}] * 2


def test_without_nodes_one_bundle_on_this_host():
    (bundle,) = plan_bundles(_routing(), "cpu", {"CPU": 8.0, "node:10.0.0.5": 1.0}, host="10.0.0.5")
    assert bundle.ranks == (0, 1) and bundle.resources == {"CPU": 2.0, "node:10.0.0.5": 0.001}


def test_missing_resources_names_the_shortfall():
    bundles = [Bundle("a", (0, 1), {"CPU": 2.0}), Bundle("b", (2,), {"CPU": 1.0, "mstar_node_b": 0.001})]
    nodes = [{"Alive": True, "Resources": {"CPU": 1.0}}, {"Alive": False, "Resources": {"CPU": 8.0}}]
    why = missing_resources(bundles, nodes)
    assert "node 'a' needs CPU=2, the largest Ray node has 1" in why
    assert "node 'b' needs mstar_node_b=0.001, the largest Ray node has 0" in why
    spread = missing_resources([Bundle("a", (0,), {"CPU": 1.0})] * 3, [{"Alive": True, "Resources": {"CPU": 4.0}}])
    assert "3 bundle(s) on distinct Ray nodes: the cluster has 1 live node(s)" in spread
