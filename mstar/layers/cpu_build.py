"""Building and loading the C++ CPU extensions in ``mstar/layers/csrc`` (compiled at install or first use).

Each extension is a few source files compiled by ``torch.utils.cpp_extension`` with
``-O3 -march=native -fopenmp`` into ``$MSTAR_KERNEL_DIR`` (default ``~/.cache/mstar/kernels``), one
directory per extension, torch version and CPU feature set (a ``-march=native`` build only runs
where the features match); later processes load the cached build (~0.2 s). ``make install`` builds
them ahead. When a build fails (no compiler, no headers) the caller's PyTorch path is used, after
one warning line; ``MSTAR_ATTENTION_KERNEL=torch`` turns every compiled kernel off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["CpuExtension", "compiled_kernels_enabled"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_STALE_LOCK_S = 600  # a build takes well under a minute


def compiled_kernels_enabled() -> bool:
    """False when ``MSTAR_ATTENTION_KERNEL=torch`` asks for the PyTorch path everywhere."""
    return os.environ.get("MSTAR_ATTENTION_KERNEL", "").strip().lower() != "torch"


def _cpu_tag() -> str:
    """A short digest of the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _csrc_digest() -> str:
    """A digest of every file in ``csrc/`` (headers too): part of the build flags, so editing any
    of them rebuilds (torch's own check covers the listed sources only)."""
    digest = hashlib.sha1()
    for path in sorted(_CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


class CpuExtension:
    """One extension: ``csrc/<source>`` for each of ``sources`` built as module ``mstar_<stem>``;
    ``get()`` is the loaded module or None (disabled, or the build failed: one warning on
    ``logger``, then silence)."""

    def __init__(self, stem: str, sources: tuple[str, ...], what: str, logger: logging.Logger) -> None:
        self.stem, self.sources, self.what, self.log = stem, sources, what, logger
        self._state: dict[str, Any] = {}

    def build_dir(self) -> Path:
        root = Path(os.environ.get("MSTAR_KERNEL_DIR", Path.home() / ".cache" / "mstar" / "kernels"))
        path = root / f"{self.stem}-torch{torch.__version__.replace('+', '_')}-{_cpu_tag()}"
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
        module = load(name=f"mstar_{self.stem}", sources=[str(_CSRC / src) for src in self.sources],
                      extra_cflags=[*_FLAGS, f"-DMSTAR_CSRC_DIGEST={_csrc_digest()}"], extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                      verbose=verbose)
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
