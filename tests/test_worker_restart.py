"""A worker process that dies: in-flight requests fail as WORKER_LOST on every rank, the rank is
respawned and serving resumes, within a bound; past it (or with ``on_worker_death="exit"``) the
runtime stays unhealthy for good."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.placement import Placement
from mstar.runtime.drivers.local import RestartPolicy
from mstar.runtime.failures import FailureKind
from tests.helpers import kv_blocks_in_use
from tests.test_runtime import PD_SPLIT, PROMPTS, tokens
from tests.toy_models import TinyAttentionLM, ToyLM


def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_restart_policy_counts_deaths_in_its_window():
    policy = RestartPolicy("restart", max_restarts=2, window_s=10.0)
    assert policy.allow(0.0) is None and policy.allow(1.0) is None
    assert "2 restart(s) already in the last 10 s" in policy.allow(2.0)
    assert policy.allow(10.5) is None  # the death at 0.0 left the window
    assert "on_worker_death is 'exit'" in RestartPolicy("exit").allow(0.0)
    with pytest.raises(ValueError, match="on_worker_death"):
        Runtime(ToyLM(), on_worker_death="ignore")


def test_messages_queued_for_a_dead_rank_are_harmless_on_its_replacement():
    """ZeroMQ delivers what was queued for the dead process to the new one: for requests it never
    knew, nothing it allocates outlives the FreeRequest the runtime sends it once it is ready."""
    from mstar.runtime.routing import Routing
    from mstar.runtime.wire.messages import ExecNode, FreeKV, FreeRequest, MigrateKV, NodeResult, StartWalk
    from mstar.runtime.worker import Worker
    from tests.test_conductor import Outbox

    model = ToyLM()
    placement = Placement.single_rank(model.graph, model=model.name).validate(model.graph)
    w = Worker(0, model, Routing(model.graph, placement), Outbox())
    ids = {"input_ids": [torch.tensor([1, 2, 3])]}
    for msg in (StartWalk("gone", "main", "prefill", 0, ids, {}),
                ExecNode("gone", "main", "decode", 1, "LLM", (0,), {"token": [torch.tensor(4)]}, {}, {}, 1),
                NodeResult("gone", "main", 5, "LLM", (0,), {}), MigrateKV("gone", "LLM", [], []),
                FreeKV("gone", "LLM")):
        w.handle(msg)
    while w.step():
        pass
    assert w.stats()["kv"]["LLM"]["blocks_used"] > 0  # the stale prefill and decode step did run
    w.handle(FreeRequest("gone"))
    stats = w.stats()
    assert stats["kv"]["LLM"]["blocks_used"] == 0 and stats["walks"] == 0 and w.next_batch() is None


def _kill(rt: Runtime, rank: int) -> None:
    os.kill(rt.worker_processes[rank].pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_then_the_bound_gives_up():
    ref = TinyAttentionLM(0)
    # prefill on rank 0, decode on rank 1: a decoding request's KV lives on rank 1 only
    with Runtime(ToyLM(), Placement.from_dict(PD_SPLIT), workers="process", max_restarts=1) as rt:
        long = [[1, 7], [1, 14]]  # no EOS before 250 tokens: still decoding when the kill is noticed
        handles = [rt.submit({"input_ids": torch.tensor(p)}, {"max_tokens": 250}) for p in long]
        for h in handles:
            next(iter(h))  # past prefill: decoding on rank 1
        decoder = rt.worker_processes[1].pid
        os.kill(decoder, signal.SIGSTOP)  # so that they cannot finish before the death is noticed
        try:
            with ThreadPoolExecutor(1) as pool:
                stats = pool.submit(rt.stats, 120.0)  # rank 1 cannot reply while stopped
                _kill(rt, 0)  # the rank that holds nothing of theirs now: they fail all the same
                for h in handles:
                    out = h.result(timeout=30)
                    assert out.status is RequestStatus.FAILED and out.failure is FailureKind.WORKER_LOST
                    assert "worker rank 0 died" in out.error
                with pytest.raises(RuntimeError, match="stats unavailable: .*worker rank 0 died"):
                    stats.result(timeout=60)  # ended by the death, not by its own 120 s timeout
        finally:
            os.kill(decoder, signal.SIGCONT)
        assert rt.unhealthy_reason.startswith("restarting: worker rank 0 died") and not rt.healthy
        assert rt.fatal is None
        with pytest.raises(RuntimeError, match="unhealthy: restarting"):
            rt.submit({"input_ids": torch.tensor([1])})
        wait_until(lambda: rt.healthy)
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], {"max_tokens": 9})
        for p, o in zip(PROMPTS, outs):
            assert tokens(o) == ref.reference_generate(p, 9), o.error
        assert kv_blocks_in_use(rt) == 0  # rank 1 freed what the failed requests held
        _kill(rt, 1)  # a second death in the window: over max_restarts=1
        wait_until(lambda: rt.fatal is not None)
        assert "worker rank 1 died" in rt.fatal and "not restarted: 1 restart(s)" in rt.fatal
        assert not rt.healthy
        with pytest.raises(RuntimeError, match="not restarted"):
            rt.submit({"input_ids": torch.tensor([1])})
        procs = list(rt.worker_processes)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_serve_exits_non_zero_when_a_worker_dies_with_the_exit_policy():
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from tests.server_utils import free_port
    from tests.test_serve_cli import ROOT, _children

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli.main", "serve", "tests.toy_server_models:ToyChat",
                             "--port", str(port), "--workers", "process", "--on-worker-death", "exit"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, timeout=120)
        (worker,) = [p for p in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.kill(worker, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1, out
        assert "the runtime cannot serve: worker rank 0 died" in out and "on_worker_death is 'exit'" in out
    finally:
        if proc.poll() is None:
            proc.kill()


class _BuildsOnce(ToyLM):
    """Builds its modules until ``marker`` exists (set before a kill: the replacement cannot start)."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def build_submodules(self, node_names):
        if os.path.exists(self.marker):
            raise ValueError("checkpoint vanished")
        return super().build_submodules(node_names)


@pytest.mark.slow
def test_a_replacement_that_cannot_start_counts_as_another_death(tmp_path):
    marker = tmp_path / "gone"
    with Runtime(_BuildsOnce(str(marker)), workers="process", max_restarts=1) as rt:
        marker.touch()
        _kill(rt, 0)
        wait_until(lambda: rt.fatal is not None)
        assert rt.fatal.startswith("worker rank 0 could not restart (ValueError: checkpoint vanished); "
                                   "not restarted: 1 restart(s)"), rt.fatal
        assert not rt.healthy
