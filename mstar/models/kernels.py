"""Every compiled CPU extension, built ahead (``make install``: ``python -m mstar.models.kernels``).

The core kernels (``mstar.layers.cpu_ops``) and each model family's (``mstar.models.qwen3_omni.kernels``)
are separate extensions, each behind its own lookup module; this builds them all into the kernel cache
(``mstar.layers.cpu_build``). A failed build is reported and skipped, never raised: the models then take
their PyTorch paths.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["EXTENSIONS", "build_all", "main"]

# the lookup module of each extension (each has ``build()`` and ``ops()``)
EXTENSIONS = ("mstar.layers.cpu_ops", "mstar.models.qwen3_omni.kernels")


def build_all(verbose: bool = False) -> dict[str, str | None]:
    """Build (or load the cached build of) every extension: module name -> None when it built, else
    the error's first line."""
    out: dict[str, str | None] = {}
    for name in EXTENSIONS:
        try:
            importlib.import_module(name).build(verbose)
            out[name] = None
        except Exception as exc:  # no compiler, no headers, ...: that extension's callers use PyTorch
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


def main() -> int:
    for name, error in build_all().items():
        print(f"{name}: {'built' if error is None else 'unavailable (' + error + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
