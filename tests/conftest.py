"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Pin the intra-op thread count: kernels may split work differently with more threads, and the
    claims of the tests that take this fixture hold at each count (and across them). With more than
    one thread the compiled kernels spread every call of several tasks, however small (their
    ``set_inline_work(0)``; serving runs small calls inline), so the claims cover that path too."""
    from mstar.layers import cpu_ops
    from mstar.models.qwen3_omni import kernels as omni_kernels

    # each extension is its own shared library with its own threshold
    extensions = [m for m in (cpu_ops.ops(), omni_kernels.ops()) if m is not None]
    before, works = torch.get_num_threads(), [m.inline_work() for m in extensions]
    torch.set_num_threads(request.param)
    if request.param > 1:
        for m in extensions:
            m.set_inline_work(0)
    yield request.param
    torch.set_num_threads(before)
    for m, work in zip(extensions, works):
        m.set_inline_work(work)


@pytest.fixture(scope="module")
def ext():
    """The compiled CPU kernels (``mstar.layers.cpu_ops``: panel linears, norms, paged decode
    attention, ...), built once per machine into its cache; the test skips where they cannot be."""
    from mstar.layers.cpu_ops import ops

    module = ops()
    if module is None:
        pytest.skip("the compiled CPU kernels are unavailable here (MSTAR_KERNELS=torch, or no compiler)")
    return module
