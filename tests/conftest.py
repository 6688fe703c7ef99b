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


@pytest.fixture(scope="module")
def ext():
    """The compiled CPU kernels (``mstar.layers.cpu_ops``: panel linears, norms, paged decode
    attention, ...), built once per machine into its cache; the test skips where they cannot be."""
    from mstar.layers.cpu_ops import ops

    module = ops()
    if module is None:
        pytest.skip("the compiled CPU kernels are unavailable here (MSTAR_ATTENTION_KERNEL=torch, or no compiler)")
    return module
