"""Reused shared-memory segments for large frames: the data arrives intact, a segment is reused only
once every tensor decoded from it is gone, nothing is named in /dev/shm, and a full pool falls back
to one-shot /dev/shm files."""

import gc
import os
import shutil
import tempfile
import time

import pytest
import torch

from mstar.runtime.wire.messages import Emit
from mstar.runtime.wire.shm_pool import ShmPool, pool_supported
from mstar.runtime.wire.transport import SHM_DIR, SHM_THRESHOLD, ZmqTransport

pytestmark = pytest.mark.skipif(not (pool_supported() and SHM_DIR), reason="needs memfd and /dev/shm")


@pytest.fixture
def pair():
    run_dir = tempfile.mkdtemp(prefix="mstar-pool-test-")
    a, b = ZmqTransport(run_dir, 0), ZmqTransport(run_dir, 1)
    yield a, b
    for t in (a, b):
        t.sweep_shm()
        t.close()
    shutil.rmtree(run_dir)  # the IPC socket files


def _roundtrip(a, b, value: torch.Tensor) -> torch.Tensor:
    a.send(1, Emit("r", "x", [value], None, "n", "w"))
    deadline, got = time.monotonic() + 30, []
    while not got:
        assert time.monotonic() < deadline
        got = b.recv(100)
    return got[0].value[0]


def _big(seed: int) -> torch.Tensor:
    return torch.randn(SHM_THRESHOLD // 4 + 7, generator=torch.Generator().manual_seed(seed))


def test_a_segment_is_reused_only_after_its_tensor_is_gone(pair):
    a, b = pair
    before = set(os.listdir(SHM_DIR))
    first = _roundtrip(a, b, _big(0))
    assert len(a._pool.segments) == 1 and a._pool.segments[0].view[0] == 1  # held by `first`
    second = _roundtrip(a, b, _big(1))  # cannot reuse the held segment
    assert len(a._pool.segments) == 2
    torch.testing.assert_close(first, _big(0), rtol=0, atol=0)  # not overwritten by the second frame
    torch.testing.assert_close(second, _big(1), rtol=0, atol=0)
    view = first[10:20]  # a view keeps the mapping (and the segment) busy too
    del first
    gc.collect()
    assert a._pool.segments[0].view[0] == 1
    del view, second
    gc.collect()
    assert [s.view[0] for s in a._pool.segments] == [0, 0]
    third = _roundtrip(a, b, _big(2))
    assert len(a._pool.segments) == 2  # reused
    torch.testing.assert_close(third, _big(2), rtol=0, atol=0)
    assert set(os.listdir(SHM_DIR)) == before  # memfd segments have no name in /dev/shm


def test_a_full_pool_falls_back_to_one_shot_files(pair):
    a, b = pair
    a._pool = ShmPool(cap_bytes=0)
    a.send(1, Emit("r", "x", [_big(3)], None, "n", "w"))
    assert len([n for n in os.listdir(SHM_DIR) if n.startswith(a.shm_prefix)]) == 1
    deadline, got = time.monotonic() + 30, []
    while not got:
        assert time.monotonic() < deadline
        got = b.recv(100)
    torch.testing.assert_close(got[0].value[0], _big(3), rtol=0, atol=0)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(a.shm_prefix)]  # unlinked on receipt
