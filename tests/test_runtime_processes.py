"""The same runtime with one worker process per rank, talking over ZeroMQ: outputs equal the
single-rank inline run (placement invariance), failures stay contained, nothing is orphaned."""

import os
import signal

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.placement import Placement
from mstar.runtime.failures import FailureKind
from tests.helpers import kv_blocks_in_use
from tests.test_runtime import PROMPTS, _expected_windows, _flow_inputs, tokens
from tests.toy_models import POISON, TinyAttentionLM, ToyFlow, ToyLM, ToyStream

pytestmark = pytest.mark.slow


def test_lm_in_a_worker_process_matches_reference_and_contains_failures():
    ref = TinyAttentionLM(0)
    with Runtime(ToyLM(defer_stop_check=True), workers="process") as rt:
        handles = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": 10}) for p in PROMPTS]
        bad = rt.submit({"input_ids": torch.tensor([POISON, 1])}, {"max_tokens": 10})
        for p, h in zip(PROMPTS, handles):
            assert tokens(h.result(timeout=60)) == ref.reference_generate(p, 10)
        assert bad.result(timeout=60).status is RequestStatus.FAILED and "poison" in bad.result().error
        assert kv_blocks_in_use(rt) == 0
        procs = list(rt.worker_processes)
    assert not any(p.is_alive() for p in procs)


def test_cfg_flow_across_two_processes_equals_inline():
    ins = _flow_inputs(2, seed=5)
    with Runtime(ToyFlow()) as rt:
        inline = [o.tensors("image")[0] for o in rt.generate(ins)]
    placement = Placement.from_dict({"model": "toy-flow", "node_groups": [
        {"node_names": ["LLM", "LLM_uncond"], "ranks": [0], "threads": 1},
        {"node_names": ["combine", "decoder"], "ranks": [1], "threads": 2}]})
    with Runtime(ToyFlow(), placement, workers="process") as rt:
        outs = rt.generate(ins)
        assert all(o.finished for o in outs), [o.error for o in outs]
        assert kv_blocks_in_use(rt) == 0
        assert [r["threads"] for r in rt.stats()["ranks"]] == [1, 2]  # each rank's placement threads
    for a, o in zip(inline, outs):
        torch.testing.assert_close(o.tensors("image")[0], a, atol=1e-6, rtol=1e-6)


def test_streaming_partition_on_another_process():
    placement = Placement.from_dict({"model": "toy-stream", "node_groups": [
        {"node_names": ["counter"], "ranks": [0]}, {"node_names": ["summer"], "ranks": [1]}]})
    with Runtime(ToyStream(), placement, workers="process") as rt:
        (o,) = rt.generate([{"x": torch.tensor(0.0)}])
        assert [t.tolist() for t in o.tensors("sum")] == _expected_windows()


def test_dead_worker_fails_in_flight_requests_clearly():
    rt = Runtime(ToyLM(), workers="process", on_worker_death="exit").start()
    try:
        h = rt.submit({"input_ids": torch.tensor([1, 7])}, {"max_tokens": 250})  # no EOS before 250 tokens
        next(iter(h))
        os.kill(rt.worker_processes[0].pid, signal.SIGKILL)
        out = h.result(timeout=30)
        assert out.status is RequestStatus.FAILED and "worker rank 0 died" in out.error
        assert out.failure is FailureKind.WORKER_LOST
        assert not rt.healthy and "not restarted: on_worker_death is 'exit'" in rt.fatal
        assert not rt.worker_processes[0].is_alive()  # no replacement was started
        with pytest.raises(RuntimeError, match="unhealthy"):
            rt.submit({"input_ids": torch.tensor([1])})
    finally:
        rt.shutdown()


def test_prefill_decode_split_across_processes():
    from tests.test_runtime import PD_SPLIT

    ref = TinyAttentionLM(0)
    with Runtime(ToyLM(), Placement.from_dict(PD_SPLIT), workers="process") as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], {"max_tokens": 9})
        for p, o in zip(PROMPTS, outs):
            assert tokens(o) == ref.reference_generate(p, 9), o.error
        assert kv_blocks_in_use(rt) == 0


def test_large_tensors_cross_processes_through_shared_memory(monkeypatch):
    from tests.toy_models import ToyFlow

    monkeypatch.setenv("MSTAR_SHM_THRESHOLD", "4096")  # the worker processes read it when they start
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    ins = [{"text_ids": torch.tensor([1, 2]), "latents": torch.randn(4096, 16), "time_index": torch.tensor(0)}]
    placement = Placement.from_dict({"model": "toy-flow", "node_groups": [
        {"node_names": ["LLM", "LLM_uncond"], "ranks": [0]}, {"node_names": ["combine", "decoder"], "ranks": [1]}]})
    with Runtime(ToyFlow()) as rt:
        inline = rt.generate(ins)[0].tensors("image")[0]
    with Runtime(ToyFlow(), placement, workers="process") as rt:
        (out,) = rt.generate(ins)  # 256 KiB latents between the workers: through shared memory
        assert out.finished, out.error
    torch.testing.assert_close(out.tensors("image")[0], inline, atol=1e-5, rtol=1e-5)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not [n for n in after - before if n.startswith("mstar-")]


def test_shared_memory_round_trip_is_zero_copy_on_receive(tmp_path):
    from mstar.runtime.wire.transport import ZmqTransport

    a = ZmqTransport(str(tmp_path), -1)
    b = ZmqTransport(str(tmp_path), 0)
    try:
        t = torch.randn(512, 1024)  # 2 MiB: over the shared-memory threshold
        a.send(0, {"t": t, "small": torch.ones(3)})
        msgs = []
        while not msgs:
            msgs = b.recv(1000)
        assert torch.equal(msgs[0]["t"], t) and torch.equal(msgs[0]["small"], torch.ones(3))
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(a.shm_prefix)]  # unlinked on receipt
    finally:
        a.close()
        b.close()


def test_frames_for_a_dead_rank_are_swept_and_a_message_missing_one_is_dropped(tmp_path):
    """A rank's process dies with shared-memory frames addressed to it: the driver sweeps the files
    addressed to that rank (and only those); a message whose frame was swept, delivered later to
    the rank's replacement, is dropped instead of failing its receive loop."""
    from mstar.runtime.wire.shm_pool import ShmPool
    from mstar.runtime.wire.transport import ZmqTransport

    conductor, rank0, rank1 = (ZmqTransport(str(tmp_path), a) for a in (-1, 0, 1))
    conductor._pool.close()
    conductor._pool = ShmPool(0)  # no reused segments: every large frame is a named /dev/shm file
    try:
        big = torch.randn(512, 1024)  # 2 MiB: over the shared-memory threshold
        conductor.send(0, {"t": big})
        conductor.send(1, {"t": big})
        names = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(conductor.shm_prefix))  # noqa: E731
        assert len(names()) == 2
        conductor.sweep_shm(0)  # rank 0 died
        assert len(names()) == 1 and names()[0].startswith(conductor.shm_prefix + "-to2-")
        conductor.send(0, {"t": big, "after": torch.ones(1)})
        msgs = []
        while not msgs:
            msgs = rank0.recv(1000)  # the first message's frame is gone: only the second arrives
        assert len(msgs) == 1 and torch.equal(msgs[0]["after"], torch.ones(1))
        got = []
        while not got:
            got = rank1.recv(1000)
        assert torch.equal(got[0]["t"], big) and names() == []
        conductor.send(1, {"t": big})
        conductor.sweep_shm(sender=0)  # rank 0 wrote none of them
        assert len(names()) == 1
        conductor.sweep_shm(sender=-1)  # what the conductor wrote (a mesh endpoint's own, at its end)
        assert names() == []
    finally:
        for t in (conductor, rank0, rank1):
            t.close()


class _BrokenBuild(ToyLM):
    def build_submodules(self, node_names):
        raise ValueError("checkpoint shard 3 is truncated")


class _BadPreflight(ToyLM):
    def preflight(self):
        raise ValueError("no such checkpoint directory")


def test_a_worker_that_cannot_build_its_modules_reports_why():
    rt = Runtime(_BrokenBuild(), workers="process")
    with pytest.raises(RuntimeError, match="failed to start(.|\n)*checkpoint shard 3 is truncated"):
        rt.start()


def test_preflight_fails_before_any_worker_starts():
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        Runtime(_BadPreflight(), workers="process")


def test_kv_pressure_in_a_worker_process_completes_every_request():
    from tests.test_kv_pressure import lm_requests, small_cache

    ref = TinyAttentionLM(0)
    reqs = lm_requests(12, seed=7)
    with Runtime(ToyLM(), small_cache("toy-lm", 8), workers="process") as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p, _ in reqs], [{"max_tokens": m} for _, m in reqs])
        for (p, m), o in zip(reqs, outs):
            assert o.finished, o.error
            assert tokens(o) == ref.reference_generate(p, m)
        ranks = rt.stats()["ranks"]
        assert ranks[0]["preemptions"]["LLM"] > 0 and ranks[0]["waiting"]["LLM"] == 0
        assert kv_blocks_in_use(rt) == 0
