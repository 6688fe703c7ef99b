"""Placement files: parsing, per-walk scoping, defaults and every validation error."""

from __future__ import annotations

import pickle
import textwrap

import pytest

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    GraphEdge,
    GraphNode,
    Loop,
    Parallel,
    Sequential,
    Walk,
    WalkGraph,
)
from mstar.placement import NodeGroup, Placement, PlacementError, RuntimeLimits

E = GraphEdge
CFG_VIEWS = ("LLM", "LLM_cfg_text", "LLM_cfg_img")


def bagel_graph() -> WalkGraph:
    """BAGEL-shaped toy graph: three prefill walks, image generation with and without CFG, decode."""

    def llm(name: str) -> GraphNode:
        if name == "LLM":  # only the main view forwards the current latents / timestep
            outs = [E("combine_cfg", x) for x in ("v", "prev_latents", "prev_time_index")]
        else:
            outs = [E("combine_cfg", "v_" + name.removeprefix("LLM_"))]
        return GraphNode(name, ["latents", "time_index"], outs)

    combine = GraphNode("combine_cfg", ["v", "v_cfg_text", "v_cfg_img", "prev_latents", "prev_time_index"],
                        [E(n, x) for n in CFG_VIEWS for x in ("latents", "time_index")])
    decoder = GraphNode("vae_decoder", ["latents"], [E(EMIT_TO_CLIENT, "image")])
    gen_inputs = ["latents", "time_index"]
    return WalkGraph([
        Walk("prefill_text", GraphNode("LLM", ["text_tokens"], [E(TO_STATE, "kv")]), inputs=["text_tokens"]),
        Walk("prefill_vit", Sequential([GraphNode("vit_encoder", ["image"], [E("LLM", "vit_embeds")]),
                                        GraphNode("LLM", ["vit_embeds"], [E(TO_STATE, "kv")])]),
             inputs=["image"]),
        Walk("prefill_vae", Sequential([GraphNode("vae_encoder", ["image"], [E("LLM", "vae_latents")]),
                                        GraphNode("LLM", ["vae_latents"], [E(TO_STATE, "kv")])]),
             inputs=["image"]),
        Walk("image_gen", Sequential([
            Loop(GraphNode("LLM", gen_inputs, [E("LLM", "latents"), E("LLM", "time_index")]),
                 max_iters=49, outputs=[E("vae_decoder", "latents")]),
            decoder]), inputs=gen_inputs),
        Walk("image_gen_cfg", Sequential([
            Loop(Sequential([Parallel([llm(n) for n in CFG_VIEWS]), combine]),
                 max_iters=49, outputs=[E("vae_decoder", "latents")]),
            decoder]), inputs=gen_inputs),
        Walk("decode", GraphNode("LLM", ["token"], [E(EMIT_TO_CLIENT, "text")]), inputs=["token"]),
    ])


def prefill_decode_graph() -> WalkGraph:
    return WalkGraph([
        Walk("prefill", GraphNode("LLM", ["tokens"], [E(TO_STATE, "kv")]), inputs=["tokens"]),
        Walk("decode", GraphNode("LLM", ["token"], [E(EMIT_TO_CLIENT, "text")]), inputs=["token"]),
    ])


MULTI_GPU = """\
model: "bagel"
node_groups:
  - { node_names: [vit_encoder, vae_encoder, vae_decoder], ranks: [0] }
  - { node_names: [LLM, combine_cfg],                      ranks: [0] }
  - { node_names: [LLM_cfg_text], ranks: [1], graph_walks: [image_gen_cfg] }
  - { node_names: [LLM_cfg_img],  ranks: [2], graph_walks: [image_gen_cfg] }
"""

SINGLE_GPU = """\
model: "bagel"
node_groups:
  - { node_names: [vit_encoder, vae_encoder, vae_decoder, LLM], ranks: [0] }
"""


@pytest.fixture(scope="module")
def graph() -> WalkGraph:
    return bagel_graph()


def write(tmp_path, text: str, name: str = "placement.yaml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def raises(match_all: list[str], fn, *args):
    with pytest.raises(PlacementError) as info:
        fn(*args)
    msg = str(info.value)
    for part in match_all:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


def groups(*gs: dict) -> dict:
    return {"node_groups": list(gs)}


def validate_dict(graph: WalkGraph, d: dict) -> Placement:
    return Placement.from_dict(d, source="cfg.yaml").validate(graph)


# ------------------------------------------------------------------------------------------------
# the seed files
# ------------------------------------------------------------------------------------------------
def test_multi_gpu_seed_file(tmp_path, graph):
    path = write(tmp_path, MULTI_GPU)
    p = Placement.load(path)
    assert p.source == path and p.model == "bagel" and not p.validated
    assert p.node_groups[2] == NodeGroup(("LLM_cfg_text",), (1,), ("image_gen_cfg",), 1, None)
    v = p.validate(graph)
    # every node is mentioned, so no default group is added
    assert v.validated and v.num_ranks == 3 and len(v.node_groups) == 4
    assert v.ranks_of("LLM_cfg_text", "image_gen_cfg") == (1,)
    assert v.ranks_of("LLM_cfg_img", "image_gen_cfg") == (2,)
    assert v.ranks_of("LLM", "image_gen_cfg") == (0,)
    assert v.ranks_of("combine_cfg", "image_gen_cfg") == (0,)
    assert v.ranks_of("vit_encoder", "prefill_vit") == (0,)
    for w in graph.walks:
        for n in graph.nodes_in(w):
            assert len(v.ranks_of(n, w)) == 1
    assert v.nodes_on(1) == {"LLM_cfg_text"}
    assert v.nodes_on(0, "image_gen_cfg") == {"LLM", "combine_cfg", "vae_decoder"}
    assert v.nodes_on(0, "decode") == {"LLM"}
    assert v.nodes_on(2, "decode") == frozenset()
    assert v.check_model("bagel") is v


def test_single_gpu_seed_file_places_unmentioned_nodes_on_rank_0(tmp_path, graph):
    v = Placement.load(write(tmp_path, SINGLE_GPU)).validate(graph)
    assert v.num_ranks == 1
    default = v.node_groups[-1]
    assert set(default.node_names) == {"combine_cfg", "LLM_cfg_text", "LLM_cfg_img"}
    assert default.ranks == (0,) and default.graph_walks is None
    for w in graph.walks:
        for n in graph.nodes_in(w):
            assert v.ranks_of(n, w) == (0,)
    assert v.nodes_on(0) == graph.node_names
    assert v.nodes_on(0, "image_gen_cfg") == graph.nodes_in("image_gen_cfg")


def test_validate_returns_a_copy_and_is_idempotent(tmp_path, graph):
    p = Placement.load(write(tmp_path, SINGLE_GPU))
    v = p.validate(graph)
    assert len(p.node_groups) == 1 and len(v.node_groups) == 2
    assert v.validate(graph) == v


def test_validated_placement_rejects_pairs_outside_the_graph(tmp_path, graph):
    v = Placement.load(write(tmp_path, MULTI_GPU)).validate(graph)
    raises(["not used by walk 'decode'"], v.ranks_of, "LLM_cfg_text", "decode")
    raises(["unknown walk 'nope'"], v.ranks_of, "LLM", "nope")
    raises(["unknown walk 'nope'"], v.nodes_on, 0, "nope")


def test_unvalidated_ranks_of_uses_groups_only(tmp_path):
    p = Placement.load(write(tmp_path, MULTI_GPU))
    assert p.ranks_of("LLM_cfg_text", "image_gen_cfg") == (1,)
    raises(["no placement for walk 'decode'", "node_groups[2] (LLM_cfg_text)"],
           p.ranks_of, "LLM_cfg_text", "decode")
    raises(["node 'ghost' is in no node group"], p.ranks_of, "ghost", "decode")


# ------------------------------------------------------------------------------------------------
# scoping
# ------------------------------------------------------------------------------------------------
def test_prefill_decode_split_with_two_scoped_groups():
    g = prefill_decode_graph()
    p = validate_dict(g, groups(
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"], "max_batch_size": 4},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"], "max_batch_size": 128},
    ))
    assert p.num_ranks == 2
    assert p.ranks_of("LLM", "prefill") == (0,)
    assert p.ranks_of("LLM", "decode") == (1,)
    assert p.nodes_on(0, "prefill") == {"LLM"} and p.nodes_on(0, "decode") == frozenset()
    assert p.nodes_on(1, "decode") == {"LLM"} and p.nodes_on(1) == {"LLM"}
    assert p.max_batch_size("LLM", "prefill") == 4
    assert p.max_batch_size("LLM", "decode") == 128
    assert p.max_batch_size("LLM") == 4  # walk-agnostic: the smallest


def test_scoped_group_overrides_unscoped_one(graph):
    p = validate_dict(graph, groups(
        {"node_names": ["LLM"], "ranks": [0]},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]},
    ))
    assert p.ranks_of("LLM", "decode") == (1,)
    assert p.ranks_of("LLM", "prefill_text") == (0,)
    assert p.ranks_of("LLM", "image_gen_cfg") == (0,)
    assert p.ranks_of("vae_decoder", "image_gen") == (0,)  # default group


def test_bagel_prefill_decode_split(graph):
    prefill_like = ["prefill_text", "prefill_vit", "prefill_vae", "image_gen", "image_gen_cfg"]
    p = validate_dict(graph, groups(
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": prefill_like},
        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]},
    ))
    assert [p.ranks_of("LLM", w) for w in graph.walks] == [(0,)] * 5 + [(1,)]


def test_tensor_parallel_group(graph):
    p = validate_dict(graph, groups({"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2}))
    assert p.ranks_of("LLM", "decode") == (0, 1)
    assert p.node_groups[0].tp_size == 2 and p.num_ranks == 2
    assert p.nodes_on(1) == {"LLM"}


def test_single_rank(graph):
    p = Placement.single_rank(graph, model="bagel")
    assert p.source == "<default>" and p.model == "bagel" and p.validated
    assert p.num_ranks == 1 and len(p.node_groups) == 1
    assert set(p.node_groups[0].node_names) == graph.node_names
    assert all(p.ranks_of(n, w) == (0,) for w in graph.walks for n in graph.nodes_in(w))


def test_from_dict_defaults_and_runtime_limits(graph):
    p = Placement.from_dict(groups({"node_names": ["LLM"], "ranks": [0]}))
    assert p.source == "<dict>" and p.model is None and p.name is None
    assert p.limits == RuntimeLimits(32, 1024, 16, 1024)
    assert p.max_batch_size("LLM") == 32

    d = {"name": "tuned", "runtime": {"max_batch_size": 8, "kv_cache_blocks": 4096, "kv_block_size": 32,
                                      "max_queue": 10},
         "node_groups": [{"node_names": ["LLM"], "ranks": [0], "max_batch_size": 2}]}
    p = Placement.from_dict(d).validate(graph)
    assert p.name == "tuned"
    assert p.limits == RuntimeLimits(max_batch_size=8, kv_cache_blocks=4096, kv_block_size=32, max_queue=10)
    assert p.max_batch_size("LLM") == 2 and p.max_batch_size("LLM", "decode") == 2
    assert p.max_batch_size("vae_decoder") == 8
    raises(["unknown node 'ghost'"], p.max_batch_size, "ghost")
    # partial runtime section keeps the other defaults
    p = Placement.from_dict({"runtime": {"max_queue": 7}, **groups({"node_names": ["LLM"], "ranks": [0]})})
    assert p.limits == RuntimeLimits(max_queue=7)
    assert (p.limits.scheduling, p.limits.scheduling_max_wait_ms) == ("downstream_first", 20.0)
    p = Placement.from_dict({"runtime": {"scheduling": "fcfs", "scheduling_max_wait_ms": 0},
                             **groups({"node_names": ["LLM"], "ranks": [0]})})
    assert p.limits == RuntimeLimits(scheduling="fcfs", scheduling_max_wait_ms=0.0)
    assert Placement.from_dict(p.to_dict()).limits == p.limits


def test_to_dict_round_trip_and_pickle(tmp_path, graph):
    v = Placement.load(write(tmp_path, MULTI_GPU)).validate(graph)
    again = Placement.from_dict(v.to_dict(), source=v.source).validate(graph)
    assert again == v
    clone = pickle.loads(pickle.dumps(v))
    assert clone == v and clone.walk_nodes == v.walk_nodes


def test_describe(tmp_path, graph):
    text = Placement.load(write(tmp_path, MULTI_GPU)).validate(graph).describe()
    lines = text.splitlines()
    assert "3 rank(s)" in lines[0] and "max_batch_size=32" in lines[1]
    assert "node_groups[2]: LLM_cfg_text -> ranks [1], walks [image_gen_cfg]" in text
    row = next(ln for ln in lines if ln.startswith("image_gen_cfg"))
    assert row.split()[1:] == ["-", "-", "0", "0", "0", "1", "2"]
    row = next(ln for ln in lines if ln.startswith("decode"))
    assert row.split()[1:] == ["-", "-", "-", "0", "-", "-", "-"]
    # unvalidated placements describe their scoped walks plus the rest
    text = Placement.load(write(tmp_path, MULTI_GPU)).describe()
    assert "(other walks)" in text


def test_check_model(tmp_path):
    path = write(tmp_path, MULTI_GPU)
    raises([path, "'bagel'", "'qwen3_omni'"], Placement.load(path).check_model, "qwen3_omni")
    Placement.from_dict(groups({"node_names": ["LLM"], "ranks": [0]})).check_model("anything")


# ------------------------------------------------------------------------------------------------
# errors: structure (load / from_dict)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("- just\n- a list\n", ["must be a mapping", "list"]),
    ("", ["must be a mapping", "NoneType"]),
    ("model: bagel\n", ["missing 'node_groups'"]),
    ("node_groups: {node_names: [LLM]}\n", ["node_groups must be a list"]),
    ("node_groups: []\n", ["node_groups is empty"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nmodle: bagel\n",
     ["unknown key(s) ['modle']", "valid keys: model, name, nodes, node_groups, runtime"]),
    ("model: 3\nnode_groups: [{node_names: [LLM], ranks: [0]}]\n", ["model must be a non-empty string"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: 5\n", ["runtime: must be a mapping"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {max_batch: 5}\n",
     ["runtime: unknown key(s) ['max_batch']", "valid keys: max_batch_size"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {kv_cache_blocks: 0}\n",
     ["kv_cache_blocks must be a positive int, got 0"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {kv_block_size: 16.0}\n",
     ["kv_block_size must be a positive int"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {max_queue: true}\n",
     ["max_queue must be a positive int"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {max_batch_size: -3}\n",
     ["max_batch_size must be a positive int"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {scheduling: lifo}\n",
     ["runtime.scheduling must be one of downstream_first, fcfs, got 'lifo'"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {scheduling_max_wait_ms: -1}\n",
     ["runtime.scheduling_max_wait_ms must be a number >= 0, got -1"]),
    ("node_groups: [{node_names: [LLM], ranks: [0]}]\nruntime: {scheduling_max_wait_ms: true}\n",
     ["scheduling_max_wait_ms must be a number >= 0"]),
    ("node_groups: [: bad\n", ["invalid YAML"]),
])
def test_top_level_errors(tmp_path, text, expected):
    path = write(tmp_path, text)
    raises([path, *expected], Placement.load, path)


@pytest.mark.parametrize("group, expected", [
    ("LLM", ["node_groups[1]:", "must be a mapping"]),
    ("{node_names: [LLM], ranks: [1], tp: 2}", ["node_groups[1] (LLM)", "unknown key(s) ['tp']",
                                                 "valid keys: node_names, ranks, graph_walks, tp_size"]),
    ("{ranks: [1]}", ["node_groups[1]", "missing 'node_names'"]),
    ("{node_names: [LLM]}", ["node_groups[1] (LLM)", "missing 'ranks'"]),
    ("{node_names: LLM, ranks: [1]}", ["node_groups[1]", "node_names must be a non-empty list"]),
    ("{node_names: [], ranks: [1]}", ["node_groups[1]", "node_names must be a non-empty list"]),
    ("{node_names: [LLM, 3], ranks: [1]}", ["node_groups[1]", "node_names must be a non-empty list"]),
    ("{node_names: [LLM, LLM], ranks: [1]}", ["node_groups[1] (LLM, LLM)", "'LLM' more than once"]),
    ("{node_names: [LLM], ranks: 1}", ["node_groups[1] (LLM)", "ranks must be a non-empty list of ints"]),
    ("{node_names: [LLM], ranks: []}", ["node_groups[1] (LLM)", "ranks must be a non-empty list of ints"]),
    ("{node_names: [LLM], ranks: ['1']}", ["node_groups[1] (LLM)", "ranks must be a non-empty list of ints"]),
    ("{node_names: [LLM], ranks: [1.0]}", ["node_groups[1] (LLM)", "ranks must be a non-empty list of ints"]),
    ("{node_names: [LLM], ranks: [-1]}", ["node_groups[1] (LLM)", "negative rank -1"]),
    ("{node_names: [LLM], ranks: [1, 1], tp_size: 2}", ["node_groups[1] (LLM)", "duplicate rank(s) [1]"]),
    ("{node_names: [LLM], ranks: [1], tp_size: 0}", ["node_groups[1] (LLM)", "tp_size must be a positive"]),
    ("{node_names: [LLM], ranks: [1], tp_size: two}", ["node_groups[1] (LLM)", "tp_size must be an int"]),
    ("{node_names: [LLM], ranks: [1, 2]}", ["node_groups[1] (LLM)", "has 2 rank(s) but tp_size is 1",
                                           "data-parallel replicas are not supported yet"]),
    ("{node_names: [LLM], ranks: [1, 2, 3, 4], tp_size: 2}", ["node_groups[1] (LLM)", "tp_size is 2"]),
    ("{node_names: [LLM], ranks: [1], graph_walks: []}", ["node_groups[1] (LLM)", "graph_walks must be"]),
    ("{node_names: [LLM], ranks: [1], graph_walks: decode}", ["node_groups[1] (LLM)", "graph_walks must be"]),
    ("{node_names: [LLM], ranks: [1], max_batch_size: 0}", ["node_groups[1] (LLM)", "max_batch_size must"]),
])
def test_group_structure_errors(tmp_path, group, expected):
    path = write(tmp_path, f"node_groups:\n  - {{node_names: [vae_decoder], ranks: [0]}}\n  - {group}\n")
    raises([path, *expected], Placement.load, path)


def test_conflicting_unscoped_groups(tmp_path):
    path = write(tmp_path, """\
        node_groups:
          - { node_names: [vae_decoder, LLM], ranks: [0] }
          - { node_names: [LLM], ranks: [1] }
        """)
    raises([path, "node_groups[1] (LLM)", "node_groups[0] (vae_decoder, LLM)", "'LLM'", "every walk"],
           Placement.load, path)


def test_conflicting_scoped_groups(tmp_path):
    path = write(tmp_path, """\
        node_groups:
          - { node_names: [LLM], ranks: [0], graph_walks: [prefill_text, decode] }
          - { node_names: [LLM], ranks: [1], graph_walks: [image_gen, decode] }
        """)
    raises([path, "node_groups[1] (LLM)", "node_groups[0] (LLM)", "walk 'decode'"], Placement.load, path)


def test_hand_built_groups_are_checked_by_validate(graph):
    p = Placement(model=None, node_groups=(NodeGroup(("LLM",), (0, 1)),), source="<code>")
    raises(["<code>: node_groups[0] (LLM)", "tp_size is 1"], p.validate, graph)
    with pytest.raises(PlacementError, match="kv_block_size"):
        RuntimeLimits(kv_block_size=0)


# ------------------------------------------------------------------------------------------------
# errors: against the graph (validate)
# ------------------------------------------------------------------------------------------------
def test_unknown_node(tmp_path, graph):
    path = write(tmp_path, MULTI_GPU.replace("[LLM_cfg_img]", "[LLM_cfg_image]"))
    raises([path, "node_groups[3] (LLM_cfg_image)", "unknown node 'LLM_cfg_image'",
            "LLM_cfg_img", "vit_encoder"],
           Placement.load(path).validate, graph)


def test_unknown_walk(tmp_path, graph):
    path = write(tmp_path, MULTI_GPU.replace("[LLM_cfg_text], ranks: [1], graph_walks: [image_gen_cfg]",
                                             "[LLM_cfg_text], ranks: [1], graph_walks: [image_gen_cgf]"))
    expected = f"{path}: node_groups[2] (LLM_cfg_text): unknown walk 'image_gen_cgf'; walks: [prefill_text"
    msg = raises([expected],
                 Placement.load(path).validate, graph)
    assert "image_gen_cfg" in msg


def test_scoped_node_not_used_by_walk(tmp_path, graph):
    scoped = "[LLM_cfg_text], ranks: [1], graph_walks: [image_gen_cfg]"
    path = write(tmp_path, MULTI_GPU.replace(scoped, scoped[:-1] + ", decode]"))
    raises([path, "node_groups[2] (LLM_cfg_text)", "node 'LLM_cfg_text' is not used by walk 'decode'"],
           Placement.load(path).validate, graph)


def test_node_without_placement_for_a_walk_that_uses_it(tmp_path, graph):
    path = write(tmp_path, """\
        node_groups:
          - { node_names: [vae_decoder], ranks: [0] }
          - { node_names: [LLM], ranks: [1], graph_walks: [image_gen_cfg, decode] }
        """)
    raises([path, "node_groups[1] (LLM)", "node 'LLM' has no placement for walk 'prefill_text'"],
           Placement.load(path).validate, graph)


def test_rank_gap(tmp_path, graph):
    path = write(tmp_path, MULTI_GPU.replace("ranks: [2]", "ranks: [3]"))
    raises([path, "ranks must be 0..N-1", "missing 2"], Placement.load(path).validate, graph)
    path = write(tmp_path, """\
        node_groups:
          - node_names: [vit_encoder, vae_encoder, vae_decoder, combine_cfg, LLM_cfg_text, LLM_cfg_img]
            ranks: [2]
          - { node_names: [LLM], ranks: [1] }
        """, name="gap0.yaml")
    raises([path, "missing 0"], Placement.load(path).validate, graph)


def test_default_group_fills_rank_0(graph):
    # LLM alone on rank 1: the unmentioned nodes go to rank 0, so there is no gap
    p = validate_dict(graph, groups({"node_names": ["LLM"], "ranks": [1]}))
    assert p.num_ranks == 2 and p.nodes_on(1) == {"LLM"}
    assert p.nodes_on(0) == graph.node_names - {"LLM"}


def test_kv_cache_memory_sizes_the_cache_unless_blocks_are_explicit():
    base = {"node_groups": [{"node_names": ["LLM"], "ranks": [0]}]}
    p = Placement.from_dict({**base, "runtime": {"kv_cache_memory_gib": 2}})
    assert p.limits.kv_cache_memory_gib == 2.0
    assert Placement.from_dict(p.to_dict()).limits == p.limits
    both = Placement.from_dict({**base, "runtime": {"kv_cache_memory_gib": 2, "kv_cache_blocks": 64}})
    assert both.limits.kv_cache_memory_gib is None and both.limits.kv_cache_blocks == 64
    for bad in (0, -1.5, "4G", True):
        with pytest.raises(PlacementError, match="kv_cache_memory_gib must be a positive number"):
            Placement.from_dict({**base, "runtime": {"kv_cache_memory_gib": bad}})


def test_threads_per_group_are_read_checked_and_agree_per_rank():
    from mstar.placement import PlacementError

    p = Placement.from_dict({"model": "m", "node_groups": [
        {"node_names": ["a"], "ranks": [0], "threads": 1},
        {"node_names": ["b"], "ranks": [0]},
        {"node_names": ["c"], "ranks": [1], "threads": 3}]})
    assert [p.threads_of(r) for r in (0, 1, 2)] == [1, 3, None]
    assert p.to_dict()["node_groups"][0]["threads"] == 1 and "threads" not in p.to_dict()["node_groups"][1]
    with pytest.raises(PlacementError, match="threads must be a positive int"):
        Placement.from_dict({"model": "m", "node_groups": [{"node_names": ["a"], "ranks": [0], "threads": 0}]})
    with pytest.raises(PlacementError, match="a rank has one thread count"):
        Placement.from_dict({"model": "m", "node_groups": [{"node_names": ["a"], "ranks": [0], "threads": 1},
                                                           {"node_names": ["b"], "ranks": [0], "threads": 2}]})
