"""The compiled CPU decode-attention kernel (``csrc/paged_decode.cpp``) and the backend that uses it.

Decode rows (one causal query token) read their K/V blocks in place through the block tables,
instead of gathering them into fresh tensors as the PyTorch path does; everything else (storing
new K/V, prefill chunks, block-append and read-only sequences) stays on the PyTorch path of
``mstar.layers.paged_attention``. The kernel splits the work into (row, kv heads) tasks and computes
each task on one thread in a fixed order, so a row's output is bitwise the same in any batch and
with any number of threads, for one build on one machine (it is built with ``-march=native``);
against the PyTorch path it agrees to about 1e-6.

The extension is built at first use into ``$MSTAR_KERNEL_DIR`` (default ``~/.cache/mstar/kernels``,
one directory per torch version and CPU feature set; ``make install`` builds it ahead) and loaded
from there afterwards. When it cannot be built (no
compiler) or ``MSTAR_ATTENTION_KERNEL=torch`` is set, the PyTorch path is used, with one warning
line in the first case.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from mstar.layers.attention_backends import AttentionBackend, compiled_kernels_enabled
from mstar.layers.paged_attention import DecodeRows, attend_decode_rows, paged_attention

__all__ = ["CompiledPagedBackend", "build", "kernel", "paged_decode"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_DTYPES = (torch.float32, torch.bfloat16)
_STALE_LOCK_S = 600  # a build takes well under a minute
_state: dict[str, Any] = {}


def _cpu_tag() -> str:
    """A short digest of the CPU's feature flags: a ``-march=native`` build only runs where they match."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _build_dir() -> Path:
    root = Path(os.environ.get("MSTAR_KERNEL_DIR", Path.home() / ".cache" / "mstar" / "kernels"))
    path = root / f"paged_decode-torch{torch.__version__.replace('+', '_')}-{_cpu_tag()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(verbose: bool = False) -> Any:
    """Compile (or load the cached build of) the extension; raises when it cannot be built."""
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    build_dir = _build_dir()
    lock = build_dir / "lock"  # left behind by a build that was killed: torch would wait on it forever
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    module = load(name="mstar_paged_decode", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose)
    log.info("paged decode kernel ready in %.1f s", time.perf_counter() - start)
    return module


def kernel() -> Any | None:
    """The loaded extension, or None (disabled, or the build failed: one warning, then silence)."""
    if not compiled_kernels_enabled():
        return None
    if "module" not in _state:
        try:
            _state["module"] = build()
        except Exception as exc:  # no compiler, no headers, ...: the PyTorch path still works
            log.warning("compiled paged attention unavailable, using the PyTorch path (%s: %s)",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            _state["module"] = None
    return _state["module"]


def _tables(plan: DecodeRows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' block ids as one padded int64 ``[rows, width]`` tensor and their context
    lengths (memoized on the plan)."""
    if plan.kernel_tables is None:
        width = max(row.num_blocks for row in plan.per_row)
        tables = torch.zeros(len(plan.per_row), width, dtype=torch.int64)
        for j, row in enumerate(plan.per_row):
            ids = (torch.arange(row.first, row.first + row.num_blocks) if row.blocks is None
                   else row.blocks.cpu())
            tables[j, :row.num_blocks] = ids
        ctx = torch.tensor([row.ctx for row in plan.per_row], dtype=torch.int64)
        plan.kernel_tables = (tables.to(device), ctx.to(device))
    return plan.kernel_tables


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodeRows,
                 scale: float) -> torch.Tensor:
    """``[n, Hq, D]``: the decode rows of ``plan`` through the kernel (the PyTorch path where the
    kernel does not apply: not built, not CPU, another dtype, a non-contiguous cache)."""
    ext = kernel()
    if (ext is None or q.device.type != "cpu" or k_cache.dtype not in _DTYPES
            or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return attend_decode_rows(q, k_cache, v_cache, plan, scale)
    tables, ctx = _tables(plan, q.device)
    # gathering and scaling the queries only copies and scales element by element: batch invariant
    queries = torch.mul(q.index_select(0, plan.q_rows).to(torch.float32), scale)
    return ext.paged_decode(queries, k_cache, v_cache, tables, ctx).to(q.dtype)


class CompiledPagedBackend(AttentionBackend):
    """Paged attention with decode rows through the compiled CPU kernel (module docstring)."""

    name = "compiled"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale=None):
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, decode=paged_decode)
