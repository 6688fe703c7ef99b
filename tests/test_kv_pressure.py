"""KV pressure: a request that fits the cache alone always completes, whatever the load (it waits,
or others are swapped out for it), with the tokens it gets alone; one that can never fit is
rejected at submission."""

import random

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.placement import Placement
from mstar.runtime.failures import FailureKind
from tests.helpers import kv_blocks_in_use
from tests.toy_models import TinyAttentionLM, ToyFlow, ToyLM, flow_reference


def small_cache(model: str, blocks: int, block_size: int = 4, groups=None) -> Placement:
    return Placement.from_dict({"model": model, "node_groups": groups or [{"node_names": ["LLM"], "ranks": [0]}],
                                "runtime": {"kv_cache_blocks": blocks, "kv_block_size": block_size}})


def tokens(out):
    return [int(t) for t in out.tensors("token")]


def lm_requests(n: int, seed: int, vocab: int = 30, longest: int = 14):
    rng = random.Random(seed)
    return [([rng.randrange(1, vocab) for _ in range(rng.randrange(1, longest))], rng.randrange(3, 16))
            for _ in range(n)]


def kv_totals(rt) -> dict[str, int]:
    ranks = rt.stats()["ranks"]
    return {"preemptions": sum(n for r in ranks for n in r["preemptions"].values()),
            "waiting": sum(n for r in ranks for n in r["waiting"].values()),
            "swapped": sum(kv["swapped_requests"] for r in ranks for kv in r["kv"].values())}


def test_toy_lm_under_4x_oversubscription_completes_everything_exactly():
    # 10 blocks of 4 tokens; 24 requests of up to 13 + 15 tokens each: several times the cache
    ref = TinyAttentionLM(0)
    reqs = lm_requests(24, seed=1)
    assert sum(len(p) + m for p, m in reqs) > 4 * 40
    with Runtime(ToyLM(defer_stop_check=True), small_cache("toy-lm", 10)) as rt:
        handles = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": m}) for p, m in reqs]
        aborted = {handles[3].request_id, handles[17].request_id}
        for rid in aborted:
            rt.abort(rid)
        streamed = {i: [int(item.value[0]) for item in handles[i]] for i in (0, 5, 11)}
        for (p, m), h in zip(reqs, handles):
            out = h.result(timeout=60)
            if h.request_id in aborted and out.status is RequestStatus.ABORTED:
                continue
            assert out.status is RequestStatus.FINISHED, out.error
            assert tokens(out) == ref.reference_generate(p, m)
        for i, items in streamed.items():  # streams neither repeat nor drop an item
            assert items == tokens(handles[i].result())
        totals = kv_totals(rt)
        assert totals["preemptions"] > 0 and totals["waiting"] == totals["swapped"] == 0
        assert kv_blocks_in_use(rt) == 0


def test_random_load_with_aborts_and_failures_under_pressure():
    # 150 requests into 12 blocks; 10% poisoned (fail alone), random aborts: everything else completes
    from tests.toy_models import POISON

    ref, rng = TinyAttentionLM(0), random.Random(9)
    with Runtime(ToyLM(), small_cache("toy-lm", 12)) as rt:
        jobs, aborted = [], set()
        for _ in range(150):
            prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 12))] + ([POISON] if rng.random() < 0.1
                                                                                  else [])
            m = rng.randrange(1, 16)
            jobs.append((prompt, m, rt.submit({"input_ids": torch.tensor(prompt)}, {"max_tokens": m})))
            if rng.random() < 0.15:
                rid = jobs[rng.randrange(len(jobs))][2].request_id
                aborted.add(rid)
                rt.abort(rid)
        for prompt, m, h in jobs:
            out = h.result(timeout=120)
            if POISON in prompt:
                assert out.status in (RequestStatus.FAILED, RequestStatus.ABORTED)
            elif out.status is not RequestStatus.ABORTED:
                assert out.finished and tokens(out) == ref.reference_generate(prompt, m), out.error
            else:
                assert h.request_id in aborted
        assert kv_totals(rt)["swapped"] == 0
        assert kv_blocks_in_use(rt) == 0 and rt.stats()["running_requests"] == 0


def test_a_request_needing_the_whole_cache_completes_among_others():
    ref = TinyAttentionLM(0)
    big = (list(range(1, 21)), 12)  # 32 tokens: all 8 blocks
    reqs = lm_requests(6, seed=2)
    with Runtime(ToyLM(), small_cache("toy-lm", 8)) as rt:
        handles = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": m}) for p, m in reqs[:3] + [big] + reqs[3:]]
        for (p, m), h in zip(reqs[:3] + [big] + reqs[3:], handles):
            out = h.result(timeout=60)
            assert out.finished, out.error
            assert tokens(out) == ref.reference_generate(p, m)
        assert kv_blocks_in_use(rt) == 0


def test_llama_tiny_under_pressure_matches_unpressured_tokens():
    from mstar.models.llama.model import LlamaTiny

    reqs = lm_requests(8, seed=3, vocab=250, longest=20)
    params = [{"max_tokens": m, "sampling": {"ignore_eos": True}} for _, m in reqs]
    ins = [{"input_ids": torch.tensor(p)} for p, _ in reqs]
    with Runtime(LlamaTiny()) as rt:
        alone = [tokens(rt.generate(i, p)[0]) for i, p in zip(ins, params)]
    with Runtime(LlamaTiny(), small_cache("llama-tiny", 9)) as rt:
        outs = rt.generate(ins, params)
        assert [tokens(o) for o in outs] == alone
        assert kv_totals(rt)["preemptions"] > 0 and kv_blocks_in_use(rt) == 0


def test_prefill_decode_split_under_pressure_keeps_migrated_caches():
    # decode's rank gets caches it has no room for: they wait there swapped out, and swap in later
    ref = TinyAttentionLM(0)
    reqs = lm_requests(10, seed=4)
    groups = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
              {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]
    with Runtime(ToyLM(), small_cache("toy-lm", 8, groups=groups)) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p, _ in reqs], [{"max_tokens": m} for _, m in reqs])
        for (p, m), o in zip(reqs, outs):
            assert o.finished, o.error
            assert tokens(o) == ref.reference_generate(p, m)
        assert kv_blocks_in_use(rt) == 0


def test_forked_guidance_caches_under_pressure_match_the_oracle():
    g = torch.Generator().manual_seed(5)
    ins = [{"text_ids": torch.randint(1, 30, (4 + 2 * i,), generator=g), "latents": torch.randn(2, 16, generator=g),
            "time_index": torch.tensor(0)} for i in range(6)]
    groups = [{"node_names": ["LLM", "LLM_uncond", "combine", "decoder"], "ranks": [0]}]
    with Runtime(ToyFlow(), small_cache("toy-flow", 6, groups=groups)) as rt:
        outs = rt.generate(ins)
        llm = rt.local_module("LLM")
        for i, o in zip(ins, outs):
            assert o.finished, o.error
            torch.testing.assert_close(o.tensors("image")[0], flow_reference(llm, i["text_ids"], i["latents"]),
                                       atol=1e-5, rtol=1e-5)
        assert kv_blocks_in_use(rt) == 0


def test_a_request_that_can_never_fit_is_rejected_at_submit():
    with Runtime(ToyLM(), small_cache("toy-lm", 4)) as rt:
        with pytest.raises(ValueError, match=r"up to 20 tokens .* \(5 blocks of 4\).*4 blocks \(16 tokens\)"):
            rt.submit({"input_ids": torch.tensor([1] * 12)}, {"max_tokens": 8})
        assert rt.generate({"input_ids": torch.tensor([1] * 8)}, {"max_tokens": 8})[0].finished


def test_llama_tiny_rejects_prompt_plus_max_tokens_beyond_the_cache():
    from mstar.models.llama.model import LlamaTiny

    with Runtime(LlamaTiny(), small_cache("llama-tiny", 2, block_size=8)) as rt:
        with pytest.raises(ValueError, match=r"up to 17 tokens .*'LLM'.*2 blocks \(16 tokens\)"):
            rt.submit({"input_ids": torch.tensor([5, 6, 7])}, {"max_tokens": 14})


class _NoHintLM(ToyLM):
    """A model that does not state its KV need: a request too large for the cache fails late."""

    def max_kv_tokens(self, inputs, params):
        return {}


def test_a_request_too_large_for_the_cache_fails_out_of_memory_without_blocking_others():
    ref = TinyAttentionLM(0)
    with Runtime(_NoHintLM(), small_cache("toy-lm", 4)) as rt:
        small = rt.submit({"input_ids": torch.tensor([1, 2])}, {"max_tokens": 6})
        huge = rt.submit({"input_ids": torch.tensor([3] * 20)}, {"max_tokens": 4})
        out = huge.result(timeout=30)
        assert out.status is RequestStatus.FAILED and out.failure is FailureKind.OUT_OF_MEMORY
        assert "more KV blocks" in out.error
        assert tokens(small.result(timeout=30)) == ref.reference_generate([1, 2], 6)
        assert kv_blocks_in_use(rt) == 0


# -- the engine's swap: blocks to host memory and back -------------------------------------------------
def _engine(blocks=6):
    from mstar.runtime.kv.engine import KVCacheEngine

    eng = KVCacheEngine(TinyAttentionLM(0), blocks, 4)
    for k, v in eng.kv_caches:  # distinct values in every slot
        k.copy_(torch.arange(k.numel(), dtype=k.dtype).view_as(k))
        v.copy_(-torch.arange(v.numel(), dtype=v.dtype).view_as(v))
    return eng


def _dense(eng, rid):
    return {name: (c["num_tokens"], [t.clone() for t in c["k"] + c["v"]])
            for name, c in eng.export_request(rid, free=False).items()}


def _same(a, b):
    return a.keys() == b.keys() and all(a[n][0] == b[n][0] and all(torch.equal(x, y) for x, y in zip(a[n][1], b[n][1]))
                                        for n in a)


def test_swap_out_and_in_keeps_values_and_fork_sharing():
    eng = _engine()
    m = eng.manager
    m.append_slots("a", "main", 6)
    m.fork("a", "main", "fork", 5)  # shares both blocks of main
    m.append_slots("b", "main", 4)
    before = _dense(eng, "a")
    eng.swap_out("a")
    assert m.pool.num_used == 1 and eng.is_swapped("a") and eng.holders() == ["b"]
    assert _same(_dense(eng, "a"), before)  # exported from host memory while swapped out
    m.append_slots("c", "main", 8)  # the freed blocks are reused meanwhile
    assert eng.swap_in("a")
    assert m.pool.num_used == 5 and m.block_table("a", "fork") == m.block_table("a", "main")
    assert _same(_dense(eng, "a"), before)
    assert eng.stats()["preemptions"] == 1 and eng.stats()["swapped_requests"] == 0


def test_swap_in_that_does_not_fit_changes_nothing():
    eng = _engine(4)
    eng.manager.append_slots("a", "main", 8)
    eng.swap_out("a")
    eng.manager.append_slots("b", "main", 12)
    assert not eng.swap_in("a") and eng.is_swapped("a") and eng.manager.pool.num_free == 1
    eng.free_request("a")
    assert not eng.is_swapped("a")


def test_an_import_without_room_waits_swapped_out():
    src, dst = _engine(), _engine(3)
    src.manager.append_slots("a", "main", 9)
    caches = src.export_request("a")
    dst.manager.append_slots("b", "main", 12)
    dst.import_request("a", caches)
    assert dst.is_swapped("a") and dst.manager.pool.num_free == 0
    dst.free_request("b")
    assert dst.swap_in("a") and dst.manager.num_tokens("a", "main") == 9
    assert all(torch.equal(x, y) for x, y in zip(caches["main"]["k"], dst.export_request("a")["main"]["k"]))


# -- the cache sized from memory -----------------------------------------------------------------------
TOY_BLOCK_BYTES = 2 * 1 * 4 * 1 * 8 * 4  # K and V, 1 layer, 4 tokens, 1 KV head of 8 float32


def test_kv_cache_sized_from_memory_and_checked_at_submit():
    ref = TinyAttentionLM(0)
    gib = 10 * TOY_BLOCK_BYTES / (1 << 30)
    with Runtime(ToyLM(), small_cache("toy-lm", 1000), kv_cache_memory_gib=gib) as rt:
        assert rt.stats()["ranks"][0]["kv"]["LLM"]["blocks_total"] == 10
        with pytest.raises(ValueError, match=r"\(11 blocks of 4\).*10 blocks \(40 tokens\)"):
            rt.submit({"input_ids": torch.tensor([1] * 36)}, {"max_tokens": 8})
        assert tokens(rt.generate({"input_ids": torch.tensor([1, 2])}, {"max_tokens": 5})[0]) == \
            ref.reference_generate([1, 2], 5)


def test_serve_takes_the_kv_cache_memory_flag():
    from mstar.cli.main import build_parser

    args = build_parser().parse_args(["serve", "llama-tiny", "--kv-cache-memory", "1.5"])
    assert args.kv_cache_memory == 1.5
    assert build_parser().parse_args(["serve", "llama-tiny"]).kv_cache_memory is None


def test_a_deferred_item_leaves_no_copy_on_write_pending():
    from mstar.model.submodule import ForwardInfo, KVSequence, NodeInputs
    from mstar.runtime.engine import DEFERRED, Prepared, WorkItem

    eng = _engine(5)
    m = eng.manager
    m.append_slots("a", "main", 6)
    m.fork("a", "main", "cfg")  # the half-full second block is shared
    seqs = [KVSequence("cfg", 1), KVSequence("other", 12)]  # a private copy of it, then 3 blocks: 1 too many
    item = WorkItem(0, "a", "main", "w", 0, "LLM", (), {}, {}, {}, 0)
    p = Prepared(item, NodeInputs(sequences=seqs), ForwardInfo("a", "w", "LLM", (), {}))
    assert eng._forward([p]) == [DEFERRED]
    assert m.pop_pending_copies() == [] and m.num_tokens("a", "cfg") == 6 and not m.has("a", "other")
    shared, private = m.block_table("a", "main")[1], m.block_table("a", "cfg")[1]
    k = eng.kv_caches[0][0]
    assert private != shared and torch.equal(k[private], k[shared])  # the copy was made before anything reuses it


def test_bagel_states_its_kv_need_and_context_so_too_long_requests_are_400s():
    """BAGEL's worst-case KV need is exact enough to admit a request that just fits (it completes)
    and to refuse one that cannot fit at submission, naming both numbers; its context is checked too."""
    import dataclasses

    from mstar.models.bagel.config import TINY_SPEC
    from mstar.models.bagel.model import BagelModel, BagelTiny

    g = torch.Generator().manual_seed(3)
    image = torch.randint(0, 256, (40, 52, 3), generator=g, dtype=torch.uint8)
    model = BagelTiny()
    probe = {"text_ids": [torch.randint(1, 200, (20,), generator=g)], "images": [image]}
    params = {"target": "text", "max_tokens": 6}
    need = model.max_kv_tokens(probe, model.parse_request(probe, params))["LLM"]
    blocks = -(-need // 16)
    groups = [{"node_names": list(model.graph.node_names), "ranks": [0]}]
    place = Placement.from_dict({"model": "bagel-tiny", "node_groups": groups,
                                 "runtime": {"kv_cache_blocks": blocks, "kv_block_size": 16}})
    with Runtime(model, place) as rt:
        out = rt.generate({"text_ids": probe["text_ids"][0], "images": [image]}, params)[0]
        assert out.finished, out.error
        assert kv_blocks_in_use(rt) == 0
        longer = {"text_ids": torch.randint(1, 200, (20 + blocks * 16 - need + 1,), generator=g),
                  "images": [image]}
        with pytest.raises(ValueError, match=rf"up to {blocks * 16 + 1} tokens .*'LLM'.*{blocks} blocks"):
            rt.submit(longer, params)

    short = BagelModel(load_format="dummy", spec=dataclasses.replace(
        TINY_SPEC, llm=dataclasses.replace(TINY_SPEC.llm, max_position_embeddings=64)))
    short.validate_request({"text_ids": [torch.ones(30, dtype=torch.long)]}, {"max_tokens": 31})
    with pytest.raises(ValueError, match=r"context \(32 positions\) \+ 33 to generate = 65 exceeds .*64 positions"):
        short.validate_request({"text_ids": [torch.ones(30, dtype=torch.long)]}, {"max_tokens": 32})


def test_vjepa_plan_and_rollouts_under_pressure_match_the_oracle_and_never_fits_is_refused():
    """A CEM plan (one forked cache per sample) and rollouts sharing a predictor cache that holds
    about one of them at a time: all complete with the oracle's results; a plan larger than the
    whole cache is refused at submission."""
    import torch.nn.functional as F

    from mstar.model import resolve_model
    from tests.test_vjepa2_runtime import check_against_native, oracle_plan, request

    model = resolve_model("vjepa2-ac-tiny")
    g = torch.Generator().manual_seed(6)
    ctx = F.layer_norm(torch.randn(3, 4, 64, generator=g), (64,))
    goal = F.layer_norm(torch.randn(4, 64, generator=g), (64,))
    states, past = torch.rand(3, 7, generator=g), torch.randn(2, 7, generator=g) * 0.1
    p = {"task": "plan", "horizon": 2, "samples": 6, "topk": 2, "iterations": 2, "seed": 4, "init_std": 0.1}
    plan_in = {"context": ctx, "goal": goal, "states": states, "actions": past}
    rollouts = [request(20 + i, 2, 3) for i in range(3)]
    size = 4
    def kv_tokens(inputs, params):  # of the request as the model parses it
        inputs = {k: [v] for k, v in inputs.items()}
        return model.max_kv_tokens(inputs, model.parse_request(inputs, params))["predictor"]

    need = -(-kv_tokens(plan_in, p) // size)
    groups = [{"node_names": list(model.graph.node_names), "ranks": [0]}]
    place = Placement.from_dict({"model": model.name, "node_groups": groups,
                                 "runtime": {"kv_cache_blocks": need + 3, "kv_block_size": size}})
    demand = need + sum(-(-kv_tokens(i, q) // size) for i, q in rollouts)
    assert demand > need + 3  # the cache cannot hold everything at once
    with Runtime(model, place) as rt:
        h_plan = rt.submit(plan_in, p)
        h_roll = [rt.submit(i, q) for i, q in rollouts]
        plan = h_plan.result()
        assert plan.finished, plan.error
        check_against_native(rt, rollouts, [h.result() for h in h_roll])
        pred = rt.local_module("predictor").predictor
        assert kv_blocks_in_use(rt) == 0
        with pytest.raises(ValueError, match=r"KV cache of 'predictor'"):
            rt.submit(plan_in, {**p, "samples": 64})
    torch.testing.assert_close(plan.tensors("plan")[0], oracle_plan(pred, ctx, states, past, goal, p),
                               atol=1e-4, rtol=1e-4)


def test_bagel_cfg_requests_under_pressure_give_their_latents_alone():
    """Editing requests with text and image guidance (three forked caches each) and a text request
    on a cache that holds about one of them: all complete with the latents / tokens they get alone."""
    from mstar.models.bagel.model import BagelTiny
    from tests.test_bagel_model import image, latents, text

    model = BagelTiny()
    edit = {"target": "image", "num_timesteps": 4, "output_type": "latent", "cfg_text_scale": 4.0,
            "cfg_img_scale": 2.0}
    reqs = [({"text_ids": [text("make it red")], "images": [image(1)]}, {**edit, "seed": 1}),
            ({"text_ids": [text("blue")], "images": [image(2, 48, 40)]}, {**edit, "seed": 2}),
            ({"text_ids": [text("what is it?")], "images": [image(3)]}, {"target": "text", "max_tokens": 5})]
    size = 16
    needs = [-(-model.max_kv_tokens(i, model.parse_request(i, p))["LLM"] // size) for i, p in reqs]
    groups = [{"node_names": list(model.graph.node_names), "ranks": [0]}]
    place = Placement.from_dict({"model": "bagel-tiny", "node_groups": groups,
                                 "runtime": {"kv_cache_blocks": max(needs) + 1, "kv_block_size": size}})
    assert sum(needs) > max(needs) + 1  # they cannot all hold their caches at once
    with Runtime(model) as rt:
        alone = [rt.generate(i, p)[0] for i, p in reqs]
    with Runtime(model, place) as rt:
        outs = [h.result() for h in [rt.submit(i, p) for i, p in reqs]]
        assert kv_blocks_in_use(rt) == 0
    for a, o, (_, p) in zip(alone, outs, reqs):
        assert o.finished, o.error
        if p["target"] == "image":
            torch.testing.assert_close(latents(o), latents(a), rtol=0, atol=1e-5)
        else:
            said = [int(t) for t in a.tensors("text")]
            assert len(said) == 5 and [int(t) for t in o.tensors("text")] == said
