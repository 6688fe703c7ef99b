"""``apply_tp``: a node sharded over 2 gloo processes computes the logits of the dense node.

Both processes build the same seeded node, compute dense logits (prefill then one decode step over
the paged KV cache), shard it and compute again; rank 0 writes both for the checks here.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from mstar.bench.net import free_port
from mstar.layers.paged_attention import AttentionMetadata, QueryMode
from mstar.layers.tensor_parallel import TPGroup, apply_tp, head_shard
from mstar.model.submodule import EngineInputs

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119]


def _nodes():
    """(name, node) pairs: llama-tiny (plain, and prepacked where a route runs), orpheus-tiny
    (a whole head), a one-kv-head Llama (replicated kv heads)."""
    from mstar.layers.prepack import prepack_available
    from mstar.models.llama.config import TINY
    from mstar.models.llama.model import LlamaLM, LlamaTiny
    from mstar.models.orpheus.model import OrpheusTiny

    one_kv = LlamaLM(config={**TINY.to_hf_dict(), "num_key_value_heads": 1}, load_format="dummy", seed=3)
    nodes = [("llama-tiny", LlamaTiny(prepack=False).build_submodules(["LLM"])["LLM"]),
             ("orpheus-tiny", OrpheusTiny().build_submodules(["LLM"])["LLM"]),
             ("one-kv-head", one_kv.build_submodules(["LLM"])["LLM"])]
    if prepack_available():
        nodes.append(("prepacked", LlamaTiny(prepack=True).build_submodules(["LLM"])["LLM"]))
    return nodes


def _logits(module, steps: list[list[int]]) -> torch.Tensor:
    """Logits of every token of ``steps`` appended in turn to one cache sequence."""
    spec = module.kv_spec
    caches = [(torch.zeros(2, 16, spec.num_kv_heads, spec.head_dim), torch.zeros(2, 16, spec.num_kv_heads,
                                                                               spec.head_dim))
              for _ in range(spec.num_layers)]
    out, before = [], 0
    for new in steps:
        n = len(new)
        meta = AttentionMetadata.build([n], [[0, 1]], [before + n], [QueryMode.CAUSAL_APPEND],
                                       list(range(before, before + n)))
        ei = EngineInputs(walks=["prefill"], nodes=["LLM"], request_ids=["r"], infos=[], splits={}, args=[None],
                          attention=meta, kv_caches=caches, positions=torch.arange(before, before + n),
                          num_tokens=[n])
        with torch.inference_mode():
            out.append(module.compute_logits(module.model(torch.tensor(new), ei)))
        before += n
    return torch.cat(out)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TPGroup(rank, 2)
        results = {}
        for name, node in _nodes():
            steps = [PROMPT, [PROMPT[-1]], [7]]
            dense = _logits(node, steps)
            apply_tp(node, tp)
            results[name] = {"dense": dense, "tp": _logits(node, steps), "kv_heads": node.kv_spec.num_kv_heads,
                             "prepacked": node.model.layers[0].self_attn.prepacked is not None}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", ["llama-tiny", "orpheus-tiny", "one-kv-head"])
def test_tp2_logits_match_the_dense_node(tp2_results, name):
    for rank, res in enumerate(tp2_results):
        r = res[name]
        assert r["tp"].shape == r["dense"].shape
        assert (r["tp"] - r["dense"]).abs().max().item() < 1e-5, (name, rank)
        assert torch.equal(r["tp"].argmax(-1), r["dense"].argmax(-1))
    # both ranks hold the same logits (the leader's do not depend on which rank computed what)
    assert torch.equal(tp2_results[0][name]["tp"], tp2_results[1][name]["tp"])


def test_tp2_keeps_prepacked_projections_prepacked(tp2_results):
    if "prepacked" not in tp2_results[0]:
        pytest.skip("no prepacked route here (no compiled kernels, no oneDNN)")
    r = tp2_results[0]["prepacked"]
    assert r["prepacked"] and (r["tp"] - r["dense"]).abs().max().item() < 1e-5
    assert not tp2_results[0]["llama-tiny"]["prepacked"]


def test_tp2_shards_the_kv_cache_by_head(tp2_results):
    assert tp2_results[0]["llama-tiny"]["kv_heads"] == 1  # 2 kv heads over 2 ranks
    assert tp2_results[1]["one-kv-head"]["kv_heads"] == 1  # 1 kv head: replicated


def test_head_shards_keep_gqa_groups_whole():
    # 8 q heads, 2 kv heads over 4 ranks: each kv head serves the 4 q heads of 2 ranks
    shards = [head_shard(8, 2, TPGroup(r, 4)) for r in range(4)]
    assert [(s.q0, s.nq, s.kv0, s.nkv) for s in shards] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1),
                                                          (6, 2, 1, 1)]
    for s in shards:  # q head h reads kv head h // (8 / 2)
        assert {h // 4 for h in range(s.q0, s.q0 + s.nq)} == {s.kv0}
    with pytest.raises(ValueError, match="multiple of tp_size"):
        head_shard(6, 2, TPGroup(0, 4))
    with pytest.raises(ValueError, match="kv heads"):
        head_shard(12, 3, TPGroup(0, 4))


# -- the leader's mirrored engine calls, replayed on a follower (one process, no collectives) ---------
class _Relay:
    """A transport to one follower: every message crosses the wire format, then is followed."""

    def __init__(self, follower) -> None:
        self.follower, self.calls = follower, []

    def send(self, dest: int, msg) -> None:
        from mstar.runtime.wire.serialization import decode, encode

        assert dest == 1
        msg = decode(encode(msg))
        self.calls.append(type(msg).__name__)
        self.follower.call(msg)


def _item(seq: int, rid: str, ids: list[int], decode_step: int | None = None):
    from mstar.runtime.engine import WorkItem

    walk, name = ("prefill", "input_ids") if decode_step is None else ("decode", "token")
    it = () if decode_step is None else (decode_step,)
    return WorkItem(seq, rid, "main", walk, 0, "LLM", it, {name: [torch.tensor(ids)]}, {}, {"max_tokens": 8}, 0)


def _state(eng):
    m = eng.manager
    return ({r: m.snapshot(r) for r in m.request_ids()}, {r: eng.is_swapped(r) for r in "abc"}, eng.stats(),
            [torch.cat([k, v]) for k, v in eng.kv_caches])


def test_a_follower_repeating_the_leaders_calls_keeps_the_same_pool_and_cache():
    from mstar.runtime.engine import DEFERRED
    from mstar.runtime.kv.engine import KVCacheEngine
    from mstar.runtime.tp.follower import TPFollower
    from mstar.runtime.tp.groups import TPLeaderKVEngine
    from tests.toy_models import TinyAttentionLM

    torch.manual_seed(0)
    leader, follower = TPLeaderKVEngine(TinyAttentionLM(0), 6, 4), KVCacheEngine(TinyAttentionLM(0), 6, 4)
    relay = _Relay(TPFollower({"LLM": follower}, None, None))
    leader._init_mirror("LLM", (1,), relay)
    steps = [lambda: leader.run([_item(0, "a", [1, 2, 3, 4, 5, 6, 7]), _item(1, "b", [8] * 9)]),
             lambda: leader.run([_item(2, "c", [9] * 6)]),  # 2 blocks, 1 free: deferred
             lambda: leader.swap_out("b"),
             lambda: leader.run([_item(3, "c", [9] * 6)]),
             lambda: leader.run([_item(4, "b", [5], decode_step=0)]),  # cannot swap back in: deferred
             lambda: leader.free_request("a"),
             lambda: leader.run([_item(5, "b", [5], decode_step=0)]),  # swapped in inside the run
             lambda: leader.free_request("b"), lambda: leader.free_request("c")]
    results = []
    for step in steps:
        results.append(step())
        for a, b in zip(_state(leader), _state(follower)):  # after every call, not only at the end
            assert a == b if not isinstance(a, list) else all(torch.equal(x, y) for x, y in zip(a, b))
    assert results[1] == [DEFERRED] and results[4] == [DEFERRED] and results[6] != [DEFERRED]
    # one message per call the worker made: the swap-in inside a run is the follower's own
    assert relay.calls == ["TPRun", "TPRun", "TPSwapOut", "TPRun", "TPRun", "TPFree", "TPRun", "TPFree", "TPFree"]
    assert leader.manager.pool.num_used == follower.manager.pool.num_used == 0


def test_a_failed_collective_is_a_lost_worker_not_an_internal_error():
    from mstar.layers.tensor_parallel import TPPeerLost
    from mstar.runtime.failures import FailureKind

    lost = TPPeerLost("all-reduce over tensor-parallel rank 0 of 2 failed: Connection closed by peer")
    assert FailureKind.of(lost) is FailureKind.WORKER_LOST
    wrapped = RuntimeError("node 'LLM' failed")
    wrapped.__cause__ = lost
    assert FailureKind.of(wrapped) is FailureKind.WORKER_LOST
    assert FailureKind.of(RuntimeError("a bug")) is FailureKind.INTERNAL


def test_a_follower_holds_calls_back_until_the_shard_of_an_import_arrives():
    from mstar.runtime.kv.engine import KVCacheEngine
    from mstar.runtime.tp.follower import TPFollower, TPShard
    from mstar.runtime.tp.groups import TPForget, TPFree, TPImport, TPRun
    from tests.toy_models import TinyAttentionLM

    eng = KVCacheEngine(TinyAttentionLM(0), 6, 4)
    follower = TPFollower({"LLM": eng}, None, None)
    k = [torch.ones(5, eng.kv_caches[0][0].shape[2], eng.kv_caches[0][0].shape[3])]
    follower.call(TPImport("LLM", "a", 7))
    follower.call(TPRun("LLM", [_item(0, "a", [3], decode_step=0)]))
    assert follower.waiting == 2 and eng.manager.pool.num_used == 0  # nothing ran out of order
    follower.shard(TPShard("LLM", "a", {"LLM": {"num_tokens": 5, "k": k, "v": k}}, 7))
    assert follower.waiting == 0 and eng.manager.num_tokens("a", "LLM") == 6  # imported, then appended
    follower.call(TPFree("LLM", "a"))
    follower.call(TPForget("LLM", "a"))
    follower.shard(TPShard("LLM", "a", {"LLM": {"num_tokens": 5, "k": k, "v": k}}, 8))  # late: its import never comes
    assert follower.waiting == 0 and eng.manager.pool.num_used == 0 and follower.held_shards == 0
