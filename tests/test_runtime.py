"""The runtime executes every Walk Graph primitive: results equal plain-PyTorch references, do not
depend on batch composition or placement, and leave no KV blocks or buffers behind."""

import random

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.graph import SlidingWindowChunkPolicy
from mstar.placement import Placement
from mstar.runtime import RequestError
from tests.helpers import kv_blocks_in_use
from tests.toy_models import (
    POISON,
    STREAM_STEPS,
    STRIDE,
    WINDOW,
    TinyAttentionLM,
    ToyFlow,
    ToyLM,
    ToyStream,
    flow_reference,
)

PROMPTS = [[1, 2, 3], [5, 6], [7, 8, 9, 10, 11, 12, 13], [4], [2, 2, 2, 2]]


def tokens(out):
    return [int(t) for t in out.tensors("token")]


@pytest.mark.parametrize("defer", [False, True])
def test_lm_matches_dense_reference_batched(defer):
    ref = TinyAttentionLM(0)
    with Runtime(ToyLM(defer_stop_check=defer)) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], {"max_tokens": 12})
        for p, o in zip(PROMPTS, outs):
            assert o.status is RequestStatus.FINISHED, o.error
            assert tokens(o) == ref.reference_generate(p, 12)
        stats = rt.stats()
        assert max(stats["ranks"][0]["batch_sizes"]["LLM"]) > 1  # requests were batched together
        assert kv_blocks_in_use(rt) == 0


def test_batch_invariance_and_streaming_order():
    with Runtime(ToyLM()) as rt:
        alone = [tokens(rt.generate([{"input_ids": torch.tensor(p)}], {"max_tokens": 10})[0]) for p in PROMPTS]
        together = [tokens(o) for o in rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS],
                                                    {"max_tokens": 10})]
        assert alone == together
        h = rt.submit({"input_ids": torch.tensor(PROMPTS[0])}, {"max_tokens": 10})
        streamed = [int(item.value[0]) for item in h]
        assert streamed == alone[0] and h.result().finished


def test_seeded_sampling_is_batch_invariant():
    params = {"max_tokens": 10, "sampling": {"temperature": 0.9, "top_p": 0.9, "seed": 1234}}
    with Runtime(ToyLM()) as rt:
        alone = tokens(rt.generate([{"input_ids": torch.tensor(PROMPTS[2])}], params)[0])
        mixed = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], params)
        assert tokens(mixed[2]) == alone


def test_bad_input_rejected_at_submit():
    with Runtime(ToyLM()) as rt:
        with pytest.raises(ValueError, match=r"input_ids must be non-empty token ids"):
            rt.submit({"input_ids": torch.tensor([99])})


def test_failure_fails_only_that_request_and_frees_blocks():
    ref = TinyAttentionLM(0)
    with Runtime(ToyLM()) as rt:
        good = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": 8}) for p in PROMPTS[:3]]
        bad = rt.submit({"input_ids": torch.tensor([1, POISON])}, {"max_tokens": 8})
        with pytest.raises(RequestError, match="poison"):
            list(bad)
        assert bad.result().status is RequestStatus.FAILED
        for p, h in zip(PROMPTS, good):
            assert tokens(h.result()) == ref.reference_generate(p, 8)
        assert kv_blocks_in_use(rt) == 0


def test_abort_frees_everything():
    with Runtime(ToyLM()) as rt:
        # no EOS in 250 tokens (the toy's longest run): the abort lands long before it could end
        h = rt.submit({"input_ids": torch.tensor([1, 7])}, {"max_tokens": 250})
        next(iter(h))
        rt.abort(h.request_id)
        assert h.result(timeout=30).status is RequestStatus.ABORTED
        stats = rt.stats()
        assert kv_blocks_in_use(rt) == 0 and stats["running_requests"] == 0 and stats["ranks"][0]["walks"] == 0


def test_a_request_id_label_used_twice_gives_two_requests():
    """A caller's ``request_id`` is a label: two live requests under it keep their own outputs, and
    aborting one leaves the other running (one id for both would cross their streamed values)."""
    with Runtime(ToyLM()) as rt:
        want = tokens(rt.generate({"input_ids": torch.tensor(PROMPTS[0])}, {"max_tokens": 6})[0])
        long = rt.submit({"input_ids": torch.tensor([1, 7])}, {"max_tokens": 250}, request_id="job")
        short = rt.submit({"input_ids": torch.tensor(PROMPTS[0])}, {"max_tokens": 6}, request_id="job")
        assert long.request_id != short.request_id
        assert long.request_id.startswith("job-") and short.request_id.startswith("job-")
        next(iter(long))
        rt.abort(long.request_id)
        assert long.result(timeout=30).status is RequestStatus.ABORTED
        out = short.result(timeout=30)
        assert out.status is RequestStatus.FINISHED and tokens(out) == want


def test_500_requests_with_random_aborts_and_failures_leave_no_blocks():
    rng = random.Random(0)
    with Runtime(ToyLM()) as rt:
        handles = []
        for _ in range(500):
            prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 12))]
            if rng.random() < 0.1:
                prompt.append(POISON)
            handles.append(rt.submit({"input_ids": torch.tensor(prompt)}, {"max_tokens": rng.randrange(1, 20)}))
            if rng.random() < 0.2:
                rt.abort(handles[rng.randrange(len(handles))].request_id)
        statuses = {h.result(timeout=120).status for h in handles}
        assert statuses == {RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED}
        assert kv_blocks_in_use(rt) == 0 and rt.stats()["running_requests"] == 0


def _flow_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"text_ids": torch.randint(1, 30, (3 + i,), generator=g), "latents": torch.randn(2, 16, generator=g),
             "time_index": torch.tensor(0)} for i in range(n)]


def test_cfg_parallel_views_batch_together_and_match_oracle():
    ins = _flow_inputs(3)
    with Runtime(ToyFlow()) as rt:
        outs = rt.generate(ins)
        llm = rt.local_module("LLM")
        for i, o in zip(ins, outs):
            assert o.finished, o.error
            torch.testing.assert_close(o.tensors("image")[0], flow_reference(llm, i["text_ids"], i["latents"]),
                                       atol=1e-5, rtol=1e-5)
        # the two guidance branches (views of one module) ran in the same forward
        assert any({"LLM", "LLM_uncond"} <= set(call) for call in llm.calls)
        assert kv_blocks_in_use(rt) == 0


def test_cfg_flow_is_placement_invariant():
    ins = _flow_inputs(2, seed=3)
    with Runtime(ToyFlow()) as rt:
        one = [o.tensors("image")[0] for o in rt.generate(ins)]
    placement = Placement.from_dict({"model": "toy-flow", "node_groups": [
        {"node_names": ["LLM", "LLM_uncond"], "ranks": [0]},
        {"node_names": ["combine", "decoder"], "ranks": [1]}]})
    with Runtime(ToyFlow(), placement) as rt:
        two = [o.tensors("image")[0] for o in rt.generate(ins)]
        assert all(sum(r["batch_sizes"]["combine"].values()) > 0 for r in rt.stats()["ranks"] if r["rank"] == 1)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _expected_windows():
    items = [torch.tensor(float(10 * i)) for i in range(STREAM_STEPS)]
    policy = SlidingWindowChunkPolicy(window=WINDOW, stride=STRIDE)
    chunks = policy.push(items) + policy.finish()
    return [[float(sum(c.items)), float(c.start)] for c in chunks]


@pytest.mark.parametrize("two_ranks", [False, True])
def test_streaming_partitions_fire_by_chunk_policy(two_ranks):
    placement = None
    if two_ranks:
        placement = Placement.from_dict({"model": "toy-stream", "node_groups": [
            {"node_names": ["counter"], "ranks": [0]}, {"node_names": ["summer"], "ranks": [1]}]})
    with Runtime(ToyStream(), placement) as rt:
        outs = rt.generate([{"x": torch.tensor(0.0)}, {"x": torch.tensor(0.0)}])
        for o in outs:
            assert o.finished, o.error
            assert [t.tolist() for t in o.tensors("sum")] == _expected_windows()
        assert all(r["stream_buffers"] == 0 for r in rt.stats()["ranks"])


def test_nested_loop_inside_dynamic_loop():
    from tests.toy_models import ToyNested, nested_reference

    inits = [torch.zeros(4), torch.tensor([0.5, 0.0, 0.0, 0.0])]
    frames = [3, 5]
    with Runtime(ToyNested()) as rt:
        outs = rt.generate([{"frame_codes": i} for i in inits], [{"frames": f} for f in frames])
        for o, i, f in zip(outs, inits, frames):
            assert o.finished, o.error
            assert [t.tolist() for t in o.tensors("frame")] == nested_reference(i, f)
        assert rt.stats()["ranks"][0]["walks"] == 0


def test_async_iteration_streams_items():
    import asyncio

    async def run(rt):
        h = rt.submit({"input_ids": torch.tensor([3, 4])}, {"max_tokens": 5})
        return [int(item.value[0]) async for item in h]

    with Runtime(ToyLM()) as rt:
        assert asyncio.run(run(rt)) == TinyAttentionLM(0).reference_generate([3, 4], 5)


def test_shutdown_ends_in_flight_requests_as_aborted():
    rt = Runtime(ToyLM()).start()
    h = rt.submit({"input_ids": torch.tensor([1, 2])}, {"max_tokens": 250})
    rt.shutdown()
    assert h.result(timeout=30).status in (RequestStatus.ABORTED, RequestStatus.FINISHED)
    with pytest.raises(RuntimeError, match="not started"):
        rt.submit({"input_ids": torch.tensor([1])})


PD_SPLIT = {"model": "toy-lm", "node_groups": [
    {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
    {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]}


def test_prefill_decode_split_moves_kv_between_ranks():
    ref = TinyAttentionLM(0)
    with Runtime(ToyLM(), Placement.from_dict(PD_SPLIT)) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], {"max_tokens": 9})
        for p, o in zip(PROMPTS, outs):
            assert tokens(o) == ref.reference_generate(p, 9), o.error
        ranks = rt.stats()["ranks"]
        assert sum(ranks[0]["batch_sizes"]["LLM"].values()) > 0 and sum(ranks[1]["batch_sizes"]["LLM"].values()) > 0
        assert kv_blocks_in_use(rt) == 0


def test_stream_consumed_one_item_per_loop_iteration():
    from tests.toy_models import ToyStreamLoop

    with Runtime(ToyStreamLoop()) as rt:
        ids = [torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0]), torch.tensor([2.0, 7.0])]
        outs = rt.generate([{"ids": i, "total": torch.zeros(1)} for i in ids])
        for i, o in zip(ids, outs):
            assert o.finished, o.error
            running = [float(t) for t in o.tensors("running")]
            # one step per streamed item, then one step on the empty final chunk that ends the loop
            assert running == [float(x) for x in torch.cumsum(i, 0)] + [float(i.sum())]
        assert all(r["stream_buffers"] == 0 for r in rt.stats()["ranks"])


def test_weight_sharing_views_on_different_ranks():
    ins = _flow_inputs(2, seed=9)
    placement = Placement.from_dict({"model": "toy-flow", "node_groups": [
        {"node_names": ["LLM", "combine", "decoder"], "ranks": [0]},
        {"node_names": ["LLM_uncond"], "ranks": [1], "graph_walks": ["flow"]}]})
    with Runtime(ToyFlow(uncond_prefix=None), placement) as rt:
        outs = rt.generate(ins)
        llm = rt.local_module("LLM")
        ranks = rt.stats()["ranks"]
        assert sum(ranks[1]["batch_sizes"]["LLM"].values()) > 0  # the unconditional branch ran on rank 1
        assert kv_blocks_in_use(rt) == 0
    for i, o in zip(ins, outs):
        assert o.finished, o.error
        torch.testing.assert_close(o.tensors("image")[0], flow_reference(llm, i["text_ids"], i["latents"], None),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_view_on_another_rank_forks_a_copy_of_the_cache(workers):
    # LLM_uncond forks the first token of LLM's cache, which prefill wrote on rank 0: the flow walk
    # gets a copy of the module's caches on rank 1, dropped when the walk ends
    ins = _flow_inputs(2, seed=13)
    placement = Placement.from_dict({"model": "toy-flow", "node_groups": [
        {"node_names": ["LLM", "combine", "decoder"], "ranks": [0]},
        {"node_names": ["LLM_uncond"], "ranks": [1], "graph_walks": ["flow"]}]})
    with Runtime(ToyFlow(), placement, workers=workers) as rt:
        outs = rt.generate(ins)
        ranks = rt.stats()["ranks"]
        assert sum(ranks[1]["batch_sizes"]["LLM"].values()) > 0
        assert kv_blocks_in_use(rt) == 0
    llm = ToyFlow().build_submodules(["LLM"])["LLM"]
    for i, o in zip(ins, outs):
        assert o.finished, o.error
        torch.testing.assert_close(o.tensors("image")[0], flow_reference(llm, i["text_ids"], i["latents"]),
                                   atol=1e-5, rtol=1e-5)


def test_kv_plan_positions_decode_rows_and_prompts():
    """The batch's positions: one tensor from the ints for a decode step, aranges for prompts, in
    sequence order either way."""
    import torch

    from mstar.runtime.kv.records import KVPlan

    plan = KVPlan(positions=[(7, 1), (0, 1), (130, 1)])
    assert torch.equal(plan.position_tensor(), torch.tensor([7, 0, 130]))
    plan = KVPlan(positions=[(7, 1), (0, 3), (4, 0), (130, 2)])
    got = plan.position_tensor()
    assert got.dtype == torch.long and torch.equal(got, torch.tensor([7, 0, 1, 2, 130, 131]))
