"""Building and loading the C++ CPU extensions (compiled at install or first use).

An extension is a few source files compiled by ``torch.utils.cpp_extension`` with ``-O3
-march=native -fopenmp``; the shared headers of ``mstar/layers/csrc`` (``parallel.h``, ``vec.h``,
``vec_math.h``, ``panel_linear.h``) are on every extension's include path. There are two: the core
kernels (``mstar.layers.cpu_ops``) and Qwen3-Omni's (``mstar.models.qwen3_omni.kernels``, sources in
``mstar/models/qwen3_omni/csrc``); ``mstar.models.kernels.build_all`` builds both. Kernel sources
include ``torch/types.h``, only an extension's bindings file ``torch/extension.h`` (pybind11 and the
whole C++ API), which is slow to parse.

Builds are cached under ``$MSTAR_KERNEL_DIR`` (default ``~/.cache/mstar/kernels``), one directory per
extension, torch version, CPU feature set (a ``-march=native`` build only runs where the features
match) and digest of its sources and the shared headers, so editing any of them builds afresh; later
processes load the cached build. When a build fails (no compiler, no headers) the caller's PyTorch
path is used, after one warning line.

Switches (read at every lookup, so a test may set them): ``MSTAR_KERNELS=torch`` turns every compiled
kernel off (``compiled_kernels_enabled``); ``MSTAR_ATTENTION_KERNEL=torch`` turns off only the compiled
attention (``compiled_attention_enabled``: ``mstar.layers.paged_decode``), the other kernels stay on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["CORE_CSRC", "CpuExtension", "compiled_attention_enabled", "compiled_kernels_enabled", "kernel_cache_root"]

log = logging.getLogger(__name__)

CORE_CSRC = Path(__file__).with_name("csrc")  # the core sources and the headers every extension includes
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_STALE_LOCK_S = 600  # a build takes well under a minute


def _says_torch(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "torch"


def compiled_kernels_enabled() -> bool:
    """False when ``MSTAR_KERNELS=torch`` asks for the PyTorch path of every kernel."""
    return not _says_torch("MSTAR_KERNELS")


def compiled_attention_enabled() -> bool:
    """False when ``MSTAR_KERNELS=torch`` or ``MSTAR_ATTENTION_KERNEL=torch`` (the compiled attention
    only; the linears, norms and model kernels are not affected by the latter)."""
    return compiled_kernels_enabled() and not _says_torch("MSTAR_ATTENTION_KERNEL")


def _cpu_tag() -> str:
    """A short digest of the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _digest(paths: list[Path]) -> str:
    """A digest of the sources and of every shared header (torch's own check covers the listed
    sources only, not the headers they include)."""
    digest = hashlib.sha1()
    headers = sorted(p for p in CORE_CSRC.iterdir() if p.suffix == ".h")
    for path in sorted(set(paths)) + headers:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def kernel_cache_root() -> Path:
    """Where builds are cached: ``$MSTAR_KERNEL_DIR``, else ``~/.cache/mstar/kernels``."""
    return Path(os.environ.get("MSTAR_KERNEL_DIR") or Path.home() / ".cache" / "mstar" / "kernels")


class CpuExtension:
    """One extension: ``<csrc>/<source>`` for each of ``sources`` built as module ``mstar_<stem>``;
    ``get()`` is the loaded module, built or loaded once per process, or None (disabled, or the build
    failed: one warning on ``logger``, then silence)."""

    def __init__(self, stem: str, sources: tuple[str, ...], what: str, logger: logging.Logger,
                 csrc: Path = CORE_CSRC) -> None:
        self.stem, self.what, self.log = stem, what, logger
        self.sources = [csrc / src for src in sources]
        self._state: dict[str, Any] = {}

    def build_dir(self) -> Path:
        tag = f"torch{torch.__version__.replace('+', '_')}-{_cpu_tag()}-{_digest(self.sources)}"
        path = kernel_cache_root() / f"{self.stem}-{tag}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def build(self, verbose: bool = False) -> Any:
        """Compile (or load the cached build of) the extension; raises when it cannot be built."""
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        build_dir = self.build_dir()
        lock = build_dir / "lock"  # left behind by a killed build: torch would wait on it forever
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        module = load(name=f"mstar_{self.stem}", sources=[str(src) for src in self.sources],
                      extra_cflags=_FLAGS, extra_include_paths=[str(CORE_CSRC)], extra_ldflags=["-fopenmp"],
                      build_directory=str(build_dir), verbose=verbose)
        self.log.info("%s ready in %.1f s", self.what, time.perf_counter() - start)
        return module

    def get(self) -> Any | None:
        """The loaded module, or None."""
        if not compiled_kernels_enabled():
            return None
        if "module" not in self._state:
            try:
                self._state["module"] = self.build()
            except Exception as exc:  # no compiler, no headers, ...: the PyTorch path still works
                first = str(exc).splitlines()[0] if str(exc) else ""
                self.log.warning("compiled %s unavailable, using the PyTorch path (%s: %s)", self.what,
                                 type(exc).__name__, first)
                self._state["module"] = None
        return self._state["module"]
