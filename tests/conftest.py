"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Pin the intra-op thread count: kernels may split work differently with more threads, and the
    claims of the tests that take this fixture hold at each count (and across them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
