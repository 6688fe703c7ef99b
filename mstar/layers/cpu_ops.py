"""The core compiled CPU kernels (``csrc/``), the one place they are looked up: panel linears
(``linear.cpp``), RMSNorm / LayerNorm, the in-place rotary embeddings and the row argmax
(``rowwise.cpp``) and attention over the paged cache (``paged_decode.cpp``, used through
``mstar.layers.paged_decode``), one extension whose kernels run their tasks on torch's own OpenMP
threads (``parallel.h``: one pool for torch's operators and these kernels). Model-specific kernels
live beside their family (``mstar.models.qwen3_omni.kernels``).

* ``pack(w_in_out, silu_mul)`` lays a ``[in, out]`` weight out once as column panels of 64 (each
  panel ``[in, 64]`` contiguous); ``linear(x, packed, n_out, silu_mul, residual)`` multiplies by it,
  optionally fusing ``silu(gate) * up`` (the panels then interleave gate and up columns) or a
  residual add into the store. Every output element is one float32 accumulator updated in input
  order, so a row's result is the same bits in any batch and at any thread count (figures in
  BENCHMARKS.md). bfloat16 weights packed in pairs use the CPU's bf16 dot products
  (AVX512-BF16), else they are widened to float32.
* ``argmax_rows(x)``: ``torch.argmax(x, -1)`` over rows in parallel (greedy sampling).
* ``rms_norm(x, weight, eps)`` and ``rotary_(y, cos, sin, heads, head_dim)``: one pass each
  instead of five or six PyTorch ops.

Weights may be float32 or bfloat16 (widened on load); results are float32. ``ops()`` is the
loaded extension or None (``mstar.layers.cpu_build``: built at install or first use, looked up once
per process, one warning when it cannot be built, off with ``MSTAR_KERNELS=torch``; every caller
keeps its PyTorch path). ``MSTAR_ATTENTION_KERNEL=torch`` turns off only the attention kernels
(``mstar.layers.paged_decode.kernel``).
"""

from __future__ import annotations

import logging
from typing import Any

from mstar.layers.cpu_build import CpuExtension

__all__ = ["build", "ops"]

log = logging.getLogger(__name__)

_EXTENSION = CpuExtension("cpu_ops", ("linear.cpp", "quant_linear.cpp", "rowwise.cpp", "paged_decode.cpp", "core_module.cpp"),
                         "CPU kernels", log)


def build(verbose: bool = False) -> Any:
    """Compile (or load the cached build of) the extension; raises when it cannot be built."""
    return _EXTENSION.build(verbose)


def ops() -> Any | None:
    """The loaded extension, or None (disabled, or the build failed: one warning, then silence)."""
    return _EXTENSION.get()
