"""The data plane across nodes without Ray: ``MeshTransport`` endpoints on 127.0.0.1 (IPC and shm
between endpoints of one node id, TCP with inline tensors between node ids, order kept, messages
held until the address book arrives, a dropped TCP peer reported), and worker processes forced onto
TCP (``Runtime(..., transport="tcp")``): outputs equal to one rank, a dead rank fails requests as
WORKER_LOST, nothing left behind."""

import os
import signal
import tempfile
import time
import uuid

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.placement import Placement
from mstar.runtime.failures import FailureKind
from mstar.runtime.wire.address_book import AddressBook, PeerHello
from mstar.runtime.wire.mesh_transport import MeshTransport
from mstar.runtime.wire.messages import CONDUCTOR, Emit
from mstar.runtime.wire.shm_pool import pool_supported
from mstar.runtime.wire.transport import SHM_DIR, SHM_THRESHOLD
from tests.helpers import kv_blocks_in_use
from tests.test_runtime import PD_SPLIT, PROMPTS, tokens
from tests.test_worker_restart import wait_until
from tests.toy_models import TinyAttentionLM, ToyLM


def _shm_files(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix)) if SHM_DIR else []


def _recv_n(t: MeshTransport, n: int, timeout: float = 30.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} of {n} messages"
        out += t.recv(100)
    return out


@pytest.fixture
def pair():
    """Endpoint 0 on node 'a', endpoint 1 on node 'b' and endpoint 2 on node 'a'; books exchanged."""
    run_dir = tempfile.gettempdir()
    run_id = f"mstar-t{uuid.uuid4().hex[:12]}"
    ts = [MeshTransport(run_dir, i, node, "127.0.0.1", run_id) for i, node in enumerate("aba")]
    book = AddressBook({t.own: t.endpoint for t in ts}, 1)
    for t in ts:
        t.install(book)
    yield ts
    for t in ts:
        t.sweep_shm()
        t.close()


def test_other_node_gets_big_tensors_inline_over_tcp_in_order(pair):
    a, b, _ = pair
    assert a.book.route("a", 1) == (b.endpoint.tcp, False) and b.endpoint.tcp.startswith("tcp://127.0.0.1:")
    big = torch.arange(SHM_THRESHOLD // 4 + 1000, dtype=torch.float32)  # above the shm threshold
    for i in range(20):
        a.send(1, Emit(f"r{i}", "x", [big + i] if i % 5 == 0 else [torch.tensor([i])], None, "n", "w"))
    assert _shm_files(a.shm_prefix) == [] and a._pool.segments == []  # nothing went through shared memory
    got = _recv_n(b, 20)
    assert [m.request_id for m in got] == [f"r{i}" for i in range(20)]
    for i, m in enumerate(got):
        torch.testing.assert_close(m.value[0], big + i if i % 5 == 0 else torch.tensor([i]), rtol=0, atol=0)


def test_same_node_uses_ipc_and_shared_memory(pair):
    a, _, c = pair
    assert a.book.route("a", 2) == (c.endpoint.ipc, True)
    big = torch.randn(SHM_THRESHOLD // 4 + 10, generator=torch.Generator().manual_seed(0))
    a.send(2, Emit("r", "x", [big], None, "n", "w"))
    assert len(a._pool.segments) == int(pool_supported())  # copied into a reused shared segment
    (m,) = _recv_n(c, 1)
    torch.testing.assert_close(m.value[0], big, rtol=0, atol=0)
    assert _shm_files(a.shm_prefix) == []


def test_messages_wait_for_the_book_and_keep_their_order():
    run_dir, run_id = tempfile.gettempdir(), f"mstar-t{uuid.uuid4().hex[:12]}"
    a = MeshTransport(run_dir, 0, "a", "127.0.0.1", run_id)
    b = MeshTransport(run_dir, CONDUCTOR, "b", "127.0.0.1", run_id)
    try:
        for i in range(3):
            a.send(CONDUCTOR, Emit(f"r{i}", "x", [torch.tensor([i])], None, "n", "w"))
        assert b.recv(50) == []  # not sent: a does not know where the conductor is
        b.install(AddressBook({0: a.endpoint, CONDUCTOR: b.endpoint}))
        b.send(0, PeerHello(CONDUCTOR, b.endpoint))  # control messages are not handed to the caller
        b.send(0, AddressBook({CONDUCTOR: b.endpoint}, 1))
        b.send(0, Emit("last", "x", [torch.tensor([9])], None, "n", "w"))
        (m,) = _recv_n(a, 1)
        assert m.request_id == "last" and a.hellos == {CONDUCTOR: b.endpoint}
        assert [m.request_id for m in _recv_n(b, 3)] == ["r0", "r1", "r2"]
    finally:
        a.close()
        b.close()


def test_a_dropped_tcp_peer_is_reported_lost(pair):
    a, b, _ = pair
    a.send(1, Emit("r", "x", [torch.tensor([1])], None, "n", "w"))
    _recv_n(b, 1)
    assert a.lost_peers() == set()
    b.close()
    deadline = time.monotonic() + 30
    while 1 not in a.lost_peers():
        assert time.monotonic() < deadline, "the closed peer was not reported"
        a.pull.poll(50)  # wait a little on a socket nothing sends to
    assert 2 not in a.lost_peers()


@pytest.mark.slow
def test_worker_processes_over_tcp_match_one_rank_and_leave_nothing():
    ref = TinyAttentionLM(0)
    rt = Runtime(ToyLM(), Placement.from_dict(PD_SPLIT), workers="process", transport="tcp").start()
    try:
        prefix = rt._driver.transport.shm_prefix
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], {"max_tokens": 9})
        for p, o in zip(PROMPTS, outs):
            assert tokens(o) == ref.reference_generate(p, 9), o.error
        assert kv_blocks_in_use(rt) == 0
        links = rt._driver.transport.links
        assert sorted(links) == [0, 1] and all(a.startswith("tcp://127.0.0.1:") for a in links.values())
        h = rt.submit({"input_ids": torch.tensor([1, 7])}, {"max_tokens": 250})
        next(iter(h))
        os.kill(rt.worker_processes[1].pid, signal.SIGKILL)
        out = h.result(timeout=60)
        assert out.status is RequestStatus.FAILED and out.failure is FailureKind.WORKER_LOST
        wait_until(lambda: rt.healthy)  # rank 1 restarted on a new port: every peer got the new book
        assert tokens(rt.generate([{"input_ids": torch.tensor(PROMPTS[0])}], {"max_tokens": 9})[0]) == \
            ref.reference_generate(PROMPTS[0], 9)
        old = rt.worker_processes[0]
        with rt.held():  # a dropped TCP link counts as a dead rank: the process is killed, the request fails
            h = rt.submit({"input_ids": torch.tensor([1, 7])}, {"max_tokens": 250})
            rt._driver.transport.lost.add(0)
            rt._driver._last_check = 0.0  # the driver looks at its links in its next pass
        out = h.result(timeout=60)
        assert out.status is RequestStatus.FAILED and out.failure is FailureKind.WORKER_LOST, out.error
        assert not old.is_alive()
        wait_until(lambda: rt.healthy)
        assert kv_blocks_in_use(rt) == 0
        procs = list(rt.worker_processes)
    finally:
        rt.shutdown()
    assert not any(p.is_alive() for p in procs)
    assert _shm_files(prefix) == []


def test_tcp_transport_needs_worker_processes():
    with pytest.raises(ValueError, match="transport"):
        Runtime(ToyLM(), transport="tcp")
    with pytest.raises(ValueError, match="transport"):
        Runtime(ToyLM(), workers="process", transport="rdma")
    with pytest.raises(ValueError, match="ray_address needs workers='ray'"):
        Runtime(ToyLM(), workers="process", ray_address="127.0.0.1:6379")
    with pytest.raises(ValueError, match="workers must be one of"):
        Runtime(ToyLM(), workers="threads")


def test_interrupt_ends_a_waiting_receive_at_once(tmp_path):
    import threading
    import time

    from mstar.runtime.wire.transport import ZmqTransport

    t = ZmqTransport(str(tmp_path), -1)
    try:
        timer = threading.Timer(0.05, t.interrupt)  # another thread, as a caller's command does
        timer.start()
        started = time.monotonic()
        assert t.recv(60_000) == []  # woken, with no message: the wake-up itself is not one
        assert time.monotonic() - started < 30
        timer.join()
        t.interrupt()
        t.interrupt()
        assert t.recv(0) == []  # pending wake-ups are drained, never delivered
    finally:
        t.close()
