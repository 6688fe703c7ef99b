"""The worker's steady decode path (``mstar/runtime/running_rows.py``): running rows
give exactly what the general path gives, whoever leaves, fails or is aborted, in either worker mode."""

from __future__ import annotations

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.graph import EMIT_TO_CLIENT, DynamicLoop, GraphEdge, GraphNode, Walk, WalkGraph
from mstar.models.llama.model import LlamaTiny
from mstar.runtime.kv.engine import KVCacheEngine
from mstar.runtime.walk_tracker import WalkTracker
from tests.helpers import kv_blocks_in_use
from tests.test_kv_pressure import small_cache
from tests.toy_models import ToyLM

PROMPTS = [[1, 5, 9, 13], [1, 40, 41], [1, *range(60, 75)], [1, 7], [1, 88, 89, 90, 91]]
# rows that leave at different steps (max_tokens, an EOS-free greedy run, seeded sampling), one that
# the module will not continue (a repetition penalty: the general path every step)
PARAMS = [
    {"max_tokens": 9, "sampling": {"temperature": 0.0, "ignore_eos": True}},
    {"max_tokens": 23, "sampling": {"temperature": 0.0, "ignore_eos": True}},
    {"max_tokens": 17, "sampling": {"temperature": 0.8, "top_k": 20, "seed": 7, "ignore_eos": True}},
    {"max_tokens": 4, "sampling": {"temperature": 0.0, "ignore_eos": True}},
    {"max_tokens": 14, "sampling": {"temperature": 0.0, "repetition_penalty": 1.3, "ignore_eos": True}},
]


def tokens(out) -> list[int]:
    assert out.finished, out.error
    return [int(t) for t in out.tensors("token")]


def continued(rt) -> int:
    return rt.stats()["ranks"][0]["kv"]["LLM"]["row_forwards"]


def _generate(rt, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    with rt.held():  # every request in the same first step
        handles = [rt.submit({"input_ids": torch.tensor(p)}, q) for p, q in zip(prompts, params)]
    return [tokens(h.result(timeout=120)) for h in handles]


@pytest.fixture(scope="module")
def general_path():
    """What the general path (every item prepared, every result through ``node_done``) gives."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCacheEngine, "continues_batches", False)
        with Runtime(LlamaTiny()) as rt:
            out = _generate(rt)
            assert continued(rt) == 0
    return out


def test_running_rows_rows_give_the_general_paths_tokens(general_path):
    with Runtime(LlamaTiny()) as rt:
        assert _generate(rt) == general_path
        # 24 forwards (the prefill, 22 decode steps of the longest row, its dropped speculative step): the
        # the running rows ran most of them (the first decode step, and each step after a row ended, are general)
        assert continued(rt) >= 15
        assert kv_blocks_in_use(rt) == 0 and rt.stats()["ranks"][0]["walks"] == 0
    assert [len(t) for t in general_path] == [q["max_tokens"] for q in PARAMS]


def test_running_rows_in_a_worker_process(general_path):
    with Runtime(LlamaTiny(), workers="process") as rt:
        assert _generate(rt) == general_path
        assert continued(rt) >= 10
        assert kv_blocks_in_use(rt) == 0


def test_running_rows_alone_and_batched_agree(general_path):
    with Runtime(LlamaTiny()) as rt:
        alone = [_generate(rt, [p], [q])[0] for p, q in zip(PROMPTS, PARAMS)]
    assert alone == general_path


def test_running_rows_under_kv_pressure():
    """A cache too small for every row: rows are preempted and swapped back in while others go on."""
    prompts, params = PROMPTS[:4], [{**q, "max_tokens": 30} for q in PARAMS[:4]]
    with Runtime(LlamaTiny()) as rt:
        roomy = _generate(rt, prompts, params)
    with Runtime(LlamaTiny(), small_cache("llama-tiny", 14, block_size=4)) as rt:
        assert _generate(rt, prompts, params) == roomy
        stats = rt.stats()["ranks"][0]
        assert stats["preemptions"]["LLM"] > 0 and continued(rt) > 0
        assert kv_blocks_in_use(rt) == 0


def test_abort_in_the_middle_of_running_rows():
    params = {"max_tokens": 40, "sampling": {"temperature": 0.0, "ignore_eos": True}}
    prompts = PROMPTS[:3]
    with Runtime(LlamaTiny()) as rt:
        expected = _generate(rt, prompts, [params] * 3)
        before = continued(rt)
        with rt.held():
            handles = [rt.submit({"input_ids": torch.tensor(p)}, params) for p in prompts]
        stream = iter(handles[1])
        for _ in range(6):  # well inside the running rows
            next(stream)
        rt.abort(handles[1].request_id)
        assert handles[1].result(timeout=60).status is RequestStatus.ABORTED
        assert tokens(handles[0].result(timeout=60)) == expected[0]
        assert tokens(handles[2].result(timeout=60)) == expected[2]
        assert continued(rt) > before
        assert kv_blocks_in_use(rt) == 0 and rt.stats()["ranks"][0]["walks"] == 0


def test_toy_lm_running_rows_match_its_reference():
    """The toy LM (whose module continues batches too) with rows of many lengths, both stop modes."""
    from tests.toy_models import TinyAttentionLM

    ref = TinyAttentionLM(0)
    prompts = [[3, 4], [9], [5, 6, 7, 8], [12, 2, 2], [17, 1]]
    for defer in (False, True):
        with Runtime(ToyLM(defer_stop_check=defer)) as rt:
            with rt.held():
                handles = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": 4 + 5 * i})
                           for i, p in enumerate(prompts)]
            for i, (p, h) in enumerate(zip(prompts, handles)):
                assert tokens(h.result(timeout=60)) == ref.reference_generate(p, 4 + 5 * i)
            assert continued(rt) > 0 and kv_blocks_in_use(rt) == 0


# -- the tracker's side ---------------------------------------------------------------------------------
def _loop_plan(defer: bool, max_iters: int = 6):
    node = GraphNode("LLM", ["token"], [GraphEdge("LLM", "token"), GraphEdge(EMIT_TO_CLIENT, "token")])
    graph = WalkGraph([Walk("decode", DynamicLoop(node, max_iters=max_iters, defer_stop_check=defer),
                            inputs=["token"])])
    return graph.plan("decode")


def _state(t: WalkTracker):
    frame = next(f for (loop, _), f in t.frames.items() if loop is not None)
    return frame.it, frame.deferred_stop, sorted(t.running)


@pytest.mark.parametrize("defer", [False, True])
def test_advance_equals_continuing_one_iteration_at_a_time(defer):
    plan = _loop_plan(defer)
    one, many = WalkTracker(plan, {"token": [0]}), WalkTracker(plan, {"token": [0]})
    for t in (one, many):
        [r] = t.start().ready
        assert r.iteration == (0,)
        # the first continuation looks the invariant inputs up; both trackers take it
        c = t.continue_self_loop("LLM", (0,), {"token": [1], "stop": [False]})
        assert c is not None and c.iteration == (1,) and c.inputs == {"token": [1]}
        assert [name for name, _ in c.emits] == ["token"]
    for i in range(1, 4):
        c = one.continue_self_loop("LLM", (i,), {"token": [i + 1], "stop": [False]})
        assert c.iteration == (i + 1,)
    inputs = many.catch_up_rows("LLM", (1,), (4,), {"token": [4], "stop": [False]})
    assert inputs == c.inputs == {"token": [4]}
    assert _state(one) == _state(many)
    bound = many.rows_bound("LLM", (4,))
    assert bound is not None and bound.steps_left == 1  # iteration 5 is the loop's last
    assert many.rows_bound("LLM", (3,)) is None  # not running


def test_running_rows_exits_equal_continuing_a_nested_loop_with_exits():
    """A fixed inner loop whose node feeds itself and leaves values at the loop's exits (a code
    predictor's codes, accumulated, and its running sum): iterations run as running rows, their exit
    values handed over through ``rows_exits``, then caught up, route the same values at the
    loop's end as continuing one iteration at a time."""
    from mstar.graph import Loop, Sequential

    head = GraphNode("head", ["x"], [GraphEdge("step", "code"), GraphEdge("step", "total")])
    inner = Loop(GraphNode("step", ["code", "total"], [GraphEdge("step", "code"), GraphEdge("step", "total")]),
                 max_iters=6, outputs=[GraphEdge("tail", "code"), GraphEdge("tail", "total")],
                 accumulate=["code"], name="inner")
    tail = GraphNode("tail", ["code", "total"], [GraphEdge(EMIT_TO_CLIENT, "frame")])
    plan = WalkGraph([Walk("w", Loop(Sequential([head, inner, tail]), max_iters=3, name="outer"),
                           inputs=["x"])]).plan("w")

    def outputs(i):
        return {"code": [torch.tensor([10 + i])], "total": [torch.tensor([float(i)])]}

    ended = []
    for as_rows in (False, True):
        t = WalkTracker(plan, {"x": [torch.zeros(1)]})
        [r] = t.start().ready
        [r] = t.node_done("head", r.iteration, {"code": [torch.tensor([9])], "total": [torch.tensor([0.0])]}).ready
        assert r.node == "step" and r.iteration == (0, 0)
        assert t.rows_exits("step", (0, 0)) is not None and t.rows_exits("head", (0,)) is None
        c = t.continue_self_loop("step", (0, 0), outputs(0))  # the first continuation: looked up
        assert c.iteration == (0, 1)
        if as_rows:
            bound = t.rows_bound("step", (0, 1))
            assert bound is not None and bound.steps_left == 4 and bound.exits == ("code", "total")
            exits = t.rows_exits("step", (0, 1))
            for i in range(1, 5):  # what the worker does for iterations 1..4, then catches up
                exits.add([outputs(i)[name][0] for name in bound.exits])
            inputs = t.catch_up_rows("step", (0, 1), (0, 5), outputs(4))
        else:
            for i in range(1, 5):
                c = t.continue_self_loop("step", (0, i), outputs(i))
            inputs = c.inputs
        assert inputs == {"code": outputs(4)["code"], "total": outputs(4)["total"]}
        [r] = t.node_done("step", (0, 5), outputs(5)).ready  # the loop's last iteration: its end
        assert r.node == "tail"
        ended.append(r.inputs)
    assert [int(c) for c in ended[0]["code"]] == [int(c) for c in ended[1]["code"]] == list(range(10, 16))
    assert torch.equal(ended[0]["total"][0], ended[1]["total"][0]) and float(ended[1]["total"][0]) == 5.0


@pytest.mark.parametrize("defer", [False, True])
def test_continue_declines_what_node_done_must_decide(defer):
    plan = _loop_plan(defer, max_iters=3)
    t = WalkTracker(plan, {"token": [0]})
    t.start()
    assert t.continue_self_loop("LLM", (5,), {"token": [1], "stop": [False]}) is None  # not running
    assert t.continue_self_loop("LLM", (0,), {"token": [1]}) is None  # no stop flag
    state = _state(t)
    if defer:  # the flag is read one iteration late: the next one runs, then is dropped
        assert t.continue_self_loop("LLM", (0,), {"token": [1], "stop": [True]}) is not None
        assert t.continue_self_loop("LLM", (1,), {"token": [2], "stop": [False]}) is None
        fx = t.node_done("LLM", (1,), {"token": [2], "stop": [False]})
        assert fx.done and not fx.emits  # the speculative iteration's token is not sent
    else:
        assert t.continue_self_loop("LLM", (0,), {"token": [1], "stop": [True]}) is None
        assert _state(t) == state  # declining changed nothing
        assert t.continue_self_loop("LLM", (0,), {"token": [1], "stop": [False]}).iteration == (1,)
        assert t.continue_self_loop("LLM", (1,), {"token": [2], "stop": [False]}).iteration == (2,)
        assert t.continue_self_loop("LLM", (2,), {"token": [3], "stop": [False]}) is None  # the bound (3)
        fx = t.node_done("LLM", (2,), {"token": [3], "stop": [False]})
        assert fx.done and [e.value for e in fx.emits] == [[3]]


def test_a_row_failing_in_the_running_rows_fails_alone():
    """A forward that raises in the running rows goes back to the general path, which isolates the row."""
    from tests.toy_models import TinyAttentionLM

    class FailAtStep(TinyAttentionLM):
        def forward(self, graph_walk, engine_inputs, ids):
            for info, step in zip(engine_inputs.infos, [a.step for a in engine_inputs.args]):
                if info.params.get("fail_at") == step:
                    raise ValueError(f"request {info.request_id} fails at step {step}")
            return super().forward(graph_walk, engine_inputs, ids)

    class FailingLM(ToyLM):
        def build_submodules(self, node_names):
            return {"LLM": FailAtStep(self.seed)}

    ref = TinyAttentionLM(0)
    prompts = [[3, 4], [9, 2], [5, 6, 7, 8]]
    params = [{"max_tokens": 20}, {"max_tokens": 20, "fail_at": 9}, {"max_tokens": 20}]
    with Runtime(FailingLM()) as rt:
        with rt.held():
            handles = [rt.submit({"input_ids": torch.tensor(p)}, q) for p, q in zip(prompts, params)]
        bad = handles[1].result(timeout=60)
        assert bad.status is RequestStatus.FAILED and "fails at step 9" in bad.error
        for i in (0, 2):
            assert tokens(handles[i].result(timeout=60)) == ref.reference_generate(prompts[i], 20)
        assert continued(rt) > 0 and kv_blocks_in_use(rt) == 0 and rt.stats()["ranks"][0]["walks"] == 0
