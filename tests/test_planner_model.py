"""The planner's model of a deployment: forward costs fitted to traces (``planner.costs``), request
programs and gaps read from traces (``planner.programs``, ``planner.readings``), the profile
(``planner.profile``, ``planner.profiling``) and the simulator of the runtime's scheduling
(``planner.simulate``)."""

from __future__ import annotations

import numpy as np
import pytest

from mstar import Runtime
from mstar.models.llama.model import LlamaTiny
from mstar.placement import Placement
from mstar.planner import parse_workload
from mstar.planner.costs import Forward, ForwardCost, nonnegative_least_squares
from mstar.planner.measure import replay
from mstar.planner.profile import AfterIdle, Profile, RankTiming
from mstar.planner.profiling import profile_model
from mstar.planner.programs import Affine, ClassProgram, emitting_runs, parallel_branches
from mstar.planner.readings import (
    after_idle_in,
    forwards_in,
    gaps_in,
    hops_in,
    overheads_in,
    stream_gaps_in,
    wake_penalties_in,
)
from mstar.planner.simulate import simulate
from mstar.planner.workload import Arrival


def _trace(rt, model, prompt, output, label):
    # seeded sampling: a streaming model streams only some sampled tokens (Orpheus: its audio ones)
    inputs, params = model.sized_request(prompt, output, {"sampling": {"seed": 7}}, prompt * 100 + output)
    rt.submit(inputs, params, request_id=label).result()
    return rt.trace(label)[-1]


def test_traces_record_each_forwards_tokens_and_context():
    model = LlamaTiny()
    with Runtime(model) as rt:
        alone = _trace(rt, model, 10, 3, "alone")
        handles = [rt.submit(*model.sized_request(p, 3, {}, p), request_id="pair") for p in (10, 12)]
        for h in handles:
            h.result()
        pair = rt.trace("pair")
    runs = [(r["batch"], r["batch_tokens"], r["batch_context"], r["batch_attention"])
            for w in alone["walks"] for r in w["nodes"]]
    # the prompt (its tokens attend to its 10), then a token per step attending to all before it
    assert runs == [(1, 10, 10, 100), (1, 1, 11, 11), (1, 1, 12, 12), (1, 1, 13, 13)]
    forwards = forwards_in(pair, model.module_of)
    rows = sum(len(w["nodes"]) for t in pair for w in t["walks"])
    # every row is in one forward; the prompts' tokens and one per decode row, however they batched
    assert sum(f.rows for f in forwards) == rows
    assert sum(f.tokens for f in forwards) == 10 + 12 + (rows - 2)


def test_a_class_program_fitted_at_three_sizes_predicts_a_fourth_exactly():
    model = LlamaTiny()
    sizes = [(8, 4), (20, 4), (8, 9)]
    with Runtime(model) as rt:
        traces = [_trace(rt, model, p, o, f"s{p}-{o}") for p, o in sizes]
        other = _trace(rt, model, 15, 7, "other")
    program = ClassProgram.fit("chat", traces, sizes)
    expanded = program.expand(15, 7)
    seen = [(w["walk"], r["node"], r["batch_tokens"], r["batch_context"]) for w in other["walks"] for r in w["nodes"]]
    assert [(r.walk, r.node, r.tokens, r.context) for r in expanded] == seen
    assert ClassProgram.from_dict(program.to_dict()) == program
    assert emitting_runs(model.graph) == {("prefill", "LLM"), ("decode", "LLM")}


def test_program_shapes_that_change_with_the_lengths_are_refused():
    walks = [{"walk": "prefill", "partition": "main", "nodes": []}]
    with pytest.raises(ValueError, match="change with its lengths"):
        ClassProgram.fit("c", [{"walks": walks}, {"walks": walks * 2}], [(1, 2), (3, 2)])


def test_forward_costs_are_fitted_non_negative():
    truth = ForwardCost(0.5, 0.02, 0.01, 0.001)
    rng = np.random.default_rng(0)
    fs = [Forward("LLM", r, t, c, truth.ms(r, t, c)) for r, t, c in
          zip(rng.integers(1, 16, 60), rng.integers(1, 500, 60), rng.integers(1, 2000, 60))]
    fit = ForwardCost.fit(fs)
    assert fit.ms(8, 100, 900) == pytest.approx(truth.ms(8, 100, 900), rel=1e-6) and fit.error < 1e-6
    coef = nonnegative_least_squares(np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]), np.array([3.0, 2.0, 1.0]))
    assert (coef >= 0).all() and coef[1] == 0  # the falling slope is dropped
    with pytest.raises(ValueError):
        ForwardCost.fit([])


def test_a_single_odd_forward_is_drawn_about_as_often_as_it_was_measured():
    # 199 forwards on the fit, one 20x off (a worker's hiccup): the draws' mean is the measured mean,
    # not the hiccup spread over the top 5 percent of draws
    fs = [Forward("LLM", 1, 1, 0, 2.0)] * 199 + [Forward("LLM", 1, 1, 0, 40.0)]
    fit = ForwardCost.fit(fs)
    assert len(fit.spread) == 101
    draws = [fit.draw(u) for u in np.linspace(0.0, 1.0, 100_001)]
    assert float(np.mean(draws)) == pytest.approx(1.0 + 19.0 / 200, rel=0.02)
    assert float(np.median(draws)) == pytest.approx(1.0)
    few = ForwardCost.fit([Forward("LLM", 1, 1, 0, ms) for ms in (1.0, 1.1, 1.2, 0.9)])
    assert len(few.spread) == 21  # no finer than its samples


CALM = {"shared": {1: 1.0, 2: 1.0}, "split": {1: 1.0, 2: 1.0}}  # ranks computing at once slow nobody


def _profile(**changes) -> Profile:
    prog = ClassProgram.fit("chat", [
        {"walks": [{"walk": "prefill", "partition": "main", "nodes": [
            {"node": "LLM", "iteration": [], "batch": 1, "batch_tokens": p, "batch_context": p}]},
            {"walk": "decode", "partition": "main", "nodes": [
                {"node": "LLM", "iteration": [i], "batch": 1, "batch_tokens": 1, "batch_context": p + i + 1}
                for i in range(o)]}]}
        for p, o in [(10, 3), (20, 3), (10, 5)]], [(10, 3), (20, 3), (10, 5)])
    base = dict(model="llama-tiny", machine="test", cores=2, max_batch=16,
                costs={"LLM@tp1/t2": ForwardCost(1.0, 0.5, 0.1, 0.0), "LLM@tp2/t1": ForwardCost(2.0, 0.5, 0.05, 0.0)},
                timing={2: RankTiming(0.2, (AfterIdle(0.0, (0.0,), {"submit": (2.0,), "emit": (0.5,), "end": (0.3,)}),),
                                      walk_gap_ms=1.0, stream_gap_ms=0.5)},
                hop_ms=(0.0,), move_ms=Affine(3.0, 0.01),
                contention={"shared": {1: 1.0, 2: 2.0}, "split": {1: 1.0, 2: 1.0}}, threads=(2,),
                kv_bytes_per_token={"LLM": 512}, programs={"chat": prog})
    base.update(changes)
    return Profile(**base)


def _placement(groups) -> Placement:
    return Placement.from_dict({"model": "llama-tiny", "node_groups": groups})


def test_one_request_alone_is_the_sum_of_its_steps():
    model, prof = LlamaTiny(), _profile()
    pred = simulate(prof, _placement([{"node_names": ["LLM"], "ranks": [0]}]), model.graph, model.module_of,
                    [Arrival(0.0, "chat", 10, 3)])
    (r,) = pred.requests
    prefill = 1.0 + 0.5 + 0.1 * 10
    decode = 1.0 + 0.5 + 0.1
    assert r.ttft == pytest.approx((2.0 + prefill + 0.5) / 1e3)
    assert r.e2e == pytest.approx((2.0 + prefill + 1.0 + 3 * decode + 2 * 0.2 + 0.3) / 1e3)
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 2)
    calm = _profile(contention={"shared": {1: 1.0, 2: 1.0}, "split": {1: 1.0, 2: 1.0}})  # no contention
    split = simulate(calm, _placement([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
                                       {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]),
                     model.graph, model.module_of, [Arrival(0.0, "chat", 10, 3)])
    # the walk boundary moves 10 KV tokens: 3 + 0.01 * 10 ms instead of the 1 ms walk gap
    assert split.requests[0].e2e - r.e2e == pytest.approx((3.1 - 1.0) / 1e3)


def test_requests_together_batch_and_ranks_computing_at_once_slow_each_other():
    model, prof = LlamaTiny(), _profile()
    single = _placement([{"node_names": ["LLM"], "ranks": [0]}])
    two = [Arrival(0.0, "chat", 10, 3), Arrival(0.0, "chat", 10, 3)]
    pair = simulate(prof, single, model.graph, model.module_of, two)
    alone = simulate(prof, single, model.graph, model.module_of, two[:1])
    # one forward of both prompts: 0.5 + 0.1 * 10 ms more than one prompt alone
    assert pair.requests[0].ttft - alone.requests[0].ttft == pytest.approx(1.5 / 1e3)
    split = _placement([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
                        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}])
    late = [Arrival(0.0, "chat", 10, 40), Arrival(0.01, "chat", 200, 3)]
    calm = simulate(_profile(contention={"shared": {1: 1.0, 2: 1.0}, "split": {1: 1.0, 2: 1.0}}), split, model.graph, model.module_of, late)
    busy = simulate(prof, split, model.graph, model.module_of, late)
    assert busy.requests[1].ttft > calm.requests[1].ttft  # its prompt runs while rank 1 decodes
    assert busy.busy_s[0] > calm.busy_s[0] and set(busy.peak_kv_tokens) == {0, 1}


def test_a_profile_round_trips_and_a_bad_file_says_so(tmp_path):
    prof = _profile(tp_sizes=(1, 2), notes=["n"])
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="profile"):
        Profile.load(tmp_path / "bad.json")
    with pytest.raises(KeyError, match="tensor-parallel size 4"):
        prof.cost("LLM", 4)


def test_profiling_and_replaying_the_tiny_llama():
    wl = parse_workload({"arrival_rate": 50, "duration_s": 0.2, "requests": [
        {"name": "chat", "prompt_tokens": {"uniform": [8, 24]}, "output_tokens": {"uniform": [3, 6]}}]})
    model, said = LlamaTiny(), []
    prof = profile_model(model, wl, 1, max_batch=4, workers="inline", say=said.append)
    assert set(prof.programs) == {"chat"} and list(prof.costs) == [f"LLM@tp1/t{prof.cores}"] and prof.contention == {}
    assert prof.cost("LLM").samples > 10 and prof.kv_bytes_per_token["LLM"] > 0
    assert prof.rank_timing(prof.cores).step_gap_ms >= 0 and set(prof.client(prof.cores)) == {"submit", "emit", "end"}
    assert any("chat" in line for line in said) and any("after idling" in line for line in said)
    arrivals = wl.arrivals()
    placement = Placement.single_rank(model.graph, model.name)
    pred = simulate(prof, placement, model.graph, model.module_of, arrivals)
    with Runtime(model, placement) as rt:
        seen = replay(rt, model, wl, arrivals)
    assert len(pred.requests) == len(seen.requests) == len(arrivals) > 0
    assert all(0 < r.ttft <= r.e2e for r in pred.requests + seen.requests)


def test_a_stream_gap_starts_when_the_consumers_rank_is_free():
    from mstar.models.orpheus.model import OrpheusTiny

    graph = OrpheusTiny().graph
    (conn,) = graph.topology.connections
    policy = conn.chunk_policy_factory()
    first = next(i for i in range(100) if policy.push([None]))  # the push that fires the first chunk
    llm = [{"node": "LLM", "start": 1.0 + i * 2e-3, "compute_ms": 1.0, "rank": 0} for i in range(first + 2)]
    # the codec shares the LLM's rank: it waits for the next LLM step, then starts 0.3 ms after it
    codec = [{"node": "snac_decoder", "start": llm[first + 1]["start"] + 1.3e-3, "compute_ms": 1.0, "rank": 0}]
    trace = {"walks": [{"walk": "decode", "partition": "llm", "nodes": llm},
                       {"walk": "snac_chunk", "partition": "codec", "nodes": codec}]}
    assert stream_gaps_in([trace], graph) == pytest.approx([0.3])  # not 2.3: from the push's end
    codec[0]["rank"] = 1  # on a rank of its own, nothing ran before it: from the push's end
    assert stream_gaps_in([trace], graph) == pytest.approx([2.3])


def test_fewer_threads_are_profiled_with_partitions_and_parallel_branches_apart(monkeypatch):
    from mstar.models.bagel.model import BagelTiny
    from mstar.models.orpheus.model import OrpheusTiny
    from mstar.planner import profiling

    monkeypatch.setattr(profiling.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    orpheus = OrpheusTiny()  # the speech LM and its stream's codec: apart, the heavier on rank 0
    groups = profiling._spread_groups(orpheus, 2, {"LLM": 10.0, "snac_decoder": 3.0})  # 2 ranks of 2 threads
    assert groups == [{"node_names": ["LLM"], "ranks": [0], "threads": 2},
                      {"node_names": ["snac_decoder"], "ranks": [1], "threads": 2}]
    assert [g["node_names"] for g in profiling._spread_groups(orpheus, 2, {"LLM": 1.0, "snac_decoder": 3.0})] == [
        ["snac_decoder"], ["LLM"]]
    bagel = BagelTiny()  # one partition; a guided step's passes apart from its main pass, over the other ranks
    assert parallel_branches(bagel.graph) == [("image_gen_cfg", ("LLM", "LLM_cfg_img", "LLM_cfg_text"))]
    main = {"node_names": ["LLM", "combine_cfg", "vae_decoder", "vae_encoder", "vit_encoder"], "ranks": [0], "threads": 1}
    assert profiling._spread_groups(bagel, 1, {"LLM": 10.0}) == [
        main, {"node_names": ["LLM_cfg_img"], "ranks": [1], "threads": 1},
        {"node_names": ["LLM_cfg_text"], "ranks": [2], "threads": 1}]
    assert profiling._spread_groups(bagel, 2, {"LLM": 10.0}) == [  # two ranks: both passes on the other
        dict(main, threads=2), {"node_names": ["LLM_cfg_img", "LLM_cfg_text"], "ranks": [1], "threads": 2}]
    monkeypatch.setattr(profiling.os, "sched_getaffinity", lambda pid: {0})  # one rank: nothing apart
    assert profiling._spread_groups(bagel, 1, {"LLM": 10.0}) == [
        {"node_names": sorted(bagel.graph.node_names), "ranks": [0], "threads": 1}]


def test_hops_are_the_gaps_between_dependent_runs_on_two_ranks():
    walk = {"nodes": [{"start": 1.0, "compute_ms": 2.0, "rank": 0}, {"start": 1.003, "compute_ms": 1.0, "rank": 1},
                      {"start": 1.0045, "compute_ms": 1.0, "rank": 1}, {"start": 1.007, "compute_ms": 1.0, "rank": 0}]}
    assert hops_in([{"walks": [walk]}]) == pytest.approx([1.0, 1.5])  # 0 -> 1, then 1 -> 0; 1 -> 1 is no hop


def test_gaps_come_from_the_runs_of_one_request():
    trace = {"walks": [{"partition": "main", "nodes": [{"start": 1.0, "compute_ms": 2.0, "batch_context": 5}]},
                       {"partition": "main", "nodes": [{"start": 1.010, "compute_ms": 1.0, "batch_context": 6},
                                  {"start": 1.0125, "compute_ms": 1.0, "batch_context": 7}]}]}
    steps, bounds = gaps_in([trace])
    assert steps == pytest.approx([1.5]) and bounds[0][0] == 5 and bounds[0][1] == pytest.approx(8.0)
    hopping = {"walks": [{"partition": "main", "nodes": [
        {"start": start, "compute_ms": 1.0, "rank": rank, "batch_context": 5}
        for start, rank in ((1.0, 0), (1.003, 1), (1.0045, 1))]}]}
    assert gaps_in([hopping])[0] == pytest.approx([0.5])  # the hop 0 -> 1 is not a step gap


def test_a_streaming_models_program_fires_its_consumer_as_the_runtime_does():
    from mstar.models.orpheus.model import OrpheusTiny

    model = OrpheusTiny()
    sizes = [(8, 30), (16, 30), (8, 44)]
    with Runtime(model) as rt:
        traces = [_trace(rt, model, p, o, f"s{p}-{o}") for p, o in sizes]
        other = _trace(rt, model, 12, 51, "other")
    program = ClassProgram.fit("speech", traces, sizes, model.graph)
    gaps = stream_gaps_in([other], model.graph)  # one per chunk: its last item's LLM step -> the codec
    assert len(gaps) == sum(w["partition"] == "codec" for w in other["walks"]) - 1  # the final one: at the end
    assert all(g > 0 for g in gaps)
    (codec,) = program.consumers
    assert (codec.partition, codec.producer, codec.edge) == ("codec", "llm", "audio_token")
    assert codec.items.at(12, 51) == other["streamed"]["codec.snac_decoder.audio_token"]
    assert ClassProgram.from_dict(program.to_dict()) == program
    prof = _profile(programs={"speech": program}, costs={"LLM@tp1/t2": ForwardCost(1.0, 0.1, 0.01, 0.0),
                                                          "snac_decoder@tp1/t2": ForwardCost(2.0, 0.5, 0.0, 0.0)})
    placement = Placement.single_rank(model.graph, model.name)
    pred = simulate(prof, placement, model.graph, model.module_of, [Arrival(0.0, "speech", 12, 51)])
    seen: dict[str, int] = {}
    for w in other["walks"]:
        for r in w["nodes"]:
            seen[r["node"]] = seen.get(r["node"], 0) + 1
    assert pred.node_runs == seen  # every LLM step and every chunk the codec decoded
    assert len(pred.requests) == 1 and pred.requests[0].e2e > pred.requests[0].ttft
    codec_rank = Placement.from_dict({"model": "orpheus-tiny", "node_groups": [
        {"node_names": ["LLM"], "ranks": [0]}, {"node_names": ["snac_decoder"], "ranks": [1]}]})
    idle = (AfterIdle(0.0, (0.0,), {"submit": (2.0,), "emit": (0.5,), "end": (0.3,)}),)
    near, far = (simulate(_profile(programs={"speech": program}, costs=prof.costs, hop_ms=(3.0,), contention=CALM,
                                   timing={2: RankTiming(0.2, idle, walk_gap_ms=1.0, stream_gap_ms=gap)}), codec_rank,
                          model.graph, model.module_of, [Arrival(0.0, "speech", 12, 51)]) for gap in (0.5, 3.5))
    # each chunk reaches the codec's rank after the stream gap (a hop is not added: the profile measured
    # the gap across ranks): the gaps delay the end, by at most two (the others overlap the LLM; the last
    # chunk's walk and then the final chunk's, queued behind it, each wait one)
    assert 3e-3 - 1e-9 <= far.requests[0].e2e - near.requests[0].e2e <= 6e-3 + 1e-9


def test_ranks_whose_threads_outnumber_the_cores_slow_each_other_even_one_at_a_time():
    model = LlamaTiny()
    split = _placement([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
                        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}])
    one = [Arrival(0.0, "chat", 10, 3)]  # its prefill and decode never compute at once
    spin = simulate(_profile(), split, model.graph, model.module_of, one)  # 2 ranks x 2 threads on 2 cores
    calm = simulate(_profile(contention={"shared": {1: 1.0, 2: 1.0}, "split": {1: 1.0, 2: 1.0}}), split,
                    model.graph, model.module_of, one)
    compute = (1.0 + 0.5 + 0.1 * 10) + 3 * (1.0 + 0.5 + 0.1)  # the prompt and three decode steps, ms
    assert spin.requests[0].e2e - calm.requests[0].e2e == pytest.approx(compute / 1e3)  # each twice as long


def test_a_request_never_ends_before_its_first_item():
    # a large drawn emit overhead and a small end one: the first item still comes no later than the end
    model = LlamaTiny()
    prof = _profile(timing={2: RankTiming(0.2, (AfterIdle(0.0, (0.0,), {"submit": (0.0,), "emit": (50.0,), "end": (0.1,)}),))})
    pred = simulate(prof, _placement([{"node_names": ["LLM"], "ranks": [0]}]), model.graph, model.module_of,
                    [Arrival(0.0, "chat", 10, 2)])
    (r,) = pred.requests
    assert 0 < r.ttft == r.e2e and r.tpot == 0.0  # clamped to the end


def test_what_idling_costs_grows_with_the_idle_time():
    timing = RankTiming(0.2, (AfterIdle(0.003, (1.0,), {"submit": (2.0,)}), AfterIdle(0.3, (9.0,), {"submit": (5.0,)})))
    assert timing.wake_ms(0.0005) == 0.0  # a rank between steps pays nothing
    assert timing.wake_ms(0.002) == pytest.approx(0.5)  # growing to the first level's
    assert timing.wake_ms(0.1515) == pytest.approx(5.0)  # linear between the levels
    assert timing.wake_ms(10.0) == timing.wake_ms(float("inf")) == 9.0  # the last level's past it
    assert timing.client(0.0)["submit"] == 2.0 and timing.client(0.1515)["submit"] == pytest.approx(3.5)
    # a peer's message wakes a rank as a client's submit does: what the submit grew past its warm level
    assert timing.woken_ms(0.0) == 0.0 and timing.woken_ms(0.1515) == pytest.approx(1.5)
    assert timing.woken_ms(float("inf")) == pytest.approx(3.0)
    assert RankTiming.from_dict(timing.to_dict()) == timing


def test_a_kv_move_to_an_idle_rank_pays_its_wake_up():
    model = LlamaTiny()
    split = _placement([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"], "threads": 1},
                        {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"], "threads": 1}])
    levels = (AfterIdle(0.003, (0.0,), {"submit": (2.0,), "emit": (0.5,), "end": (0.3,)}),
              AfterIdle(0.3, (0.0,), {"submit": (5.0,), "emit": (0.5,), "end": (0.3,)}))
    costs = {"LLM@tp1/t1": ForwardCost(1.0, 0.5, 0.1, 0.0)}
    sleepy = _profile(costs=costs, timing={1: RankTiming(0.2, levels)}, contention=CALM)
    flat = _profile(costs=costs, timing={1: RankTiming(0.2, levels[:1])}, contention=CALM)
    one = [Arrival(0.0, "chat", 10, 3)]  # the decode rank never ran: its wake-up is the last level's
    woke, base = (simulate(p, split, model.graph, model.module_of, one).requests[0] for p in (sleepy, flat))
    # the submit to the idle prefill rank and the move to the idle decode rank: 3 ms more each
    assert woke.ttft - base.ttft == pytest.approx(3.0 / 1e3)
    assert woke.e2e - base.e2e == pytest.approx(6.0 / 1e3)


def test_a_request_after_a_long_idle_pays_the_wake_up_and_a_slower_submit():
    model = LlamaTiny()
    single = _placement([{"node_names": ["LLM"], "ranks": [0]}])
    idle = _profile(timing={2: RankTiming(0.2, (AfterIdle(0.003, (1.0,), {"submit": (2.0,), "emit": (0.5,), "end": (0.3,)}),
                                                AfterIdle(0.3, (9.0,), {"submit": (5.0,), "emit": (0.5,), "end": (0.3,)})))})
    calm = _profile()  # no wake-up, a 2 ms submit
    first = [Arrival(0.0, "chat", 10, 3)]  # the rank never ran: idle for ever
    woke = simulate(idle, single, model.graph, model.module_of, first).requests[0]
    base = simulate(calm, single, model.graph, model.module_of, first).requests[0]
    assert woke.ttft - base.ttft == pytest.approx((5.0 - 2.0 + 9.0) / 1e3)
    # a second request 3 ms after the first one's end finds the rank idle about 3 ms: the first level's
    again = simulate(idle, single, model.graph, model.module_of, first + [Arrival(woke.e2e + 0.003, "chat", 10, 3)])
    assert again.requests[1].ttft == pytest.approx(base.ttft + 1.0 / 1e3, abs=4e-4)  # the end overhead aside


def test_idle_readings_come_from_requests_one_after_another():
    def run(start: float, ms: float) -> dict:
        return {"node": "LLM", "rank": 0, "start": start, "compute_ms": ms, "batch": 1, "batch_tokens": 10,
                "batch_attention": 100}

    traces = [{"walks": [{"walk": "prefill", "nodes": [run(1.0, 2.0)]}],
               "client": {"sent": 0.999, "first": 1.0025, "end": 1.003}},
              {"walks": [{"walk": "prefill", "nodes": [run(1.305, 6.0)]}],
               "client": {"sent": 1.302, "first": 1.3115, "end": 1.312}}]
    over = overheads_in(traces, {("prefill", "LLM")})
    # the first request is left out (its rank's idle time before it unknown); the second came 0.3 s after
    assert len(over) == 1 and over[0][0] == pytest.approx(0.3)
    assert over[0][1] == pytest.approx({"submit": 3.0, "emit": 0.5, "end": 1.0})
    wakes = wake_penalties_in(traces, {"LLM@tp1/t2": ForwardCost(1.0, 0.0, 0.1, 0.0)}, 2, lambda n: n)
    assert wakes == [pytest.approx((0.303, 4.0))]  # 6 ms where the cost says 2
    (level,) = after_idle_in(wakes, over)  # both nearest the 0.3 s level
    assert level.idle_s == pytest.approx(0.3015) and level.wake[10] == 4.0 and level.client["submit"][10] == 3.0


def test_the_kv_move_is_profiled_with_the_cores_split_between_the_two_ranks():
    import os

    from mstar.planner.profiling import _kv_bytes, _split_groups

    model = LlamaTiny()
    groups = _split_groups(model, _kv_bytes(model))
    assert [(g["ranks"], g["graph_walks"]) for g in groups] == [([0], ["prefill"]), ([1], ["decode"])]
    # two ranks each spinning a thread per core would price their contention into the move
    assert {g["threads"] for g in groups} == {max(1, len(os.sched_getaffinity(0)) // 2)}
    Placement.from_dict({"model": model.name, "node_groups": groups})  # a valid placement
