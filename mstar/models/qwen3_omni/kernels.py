"""Qwen3-Omni's compiled CPU kernels (``csrc/``), the one place the family looks them up. They are the
family's own, shaped by its modules; the core kernels (linears, norms, attention) are
``mstar.layers.cpu_ops``.

* ``moe_experts`` (``moe.cpp``): a sparse MoE block's SwiGLU experts over routed tokens in one call,
  over the expert weights packed by the core ``pack`` (``Experts`` in ``moe.py``);
* ``snake_beta``, ``narrow_conv1d``, ``residual_unit``, ``upsample_taps`` (``code2wav.cpp``): the
  Code2Wav vocoder's activation, stride-1 convolutions, residual units in one pass and the
  interleaving of a transposed convolution's taps (``code2wav_modules.py``, ``code2wav_batch.py``).

``ops()`` is the loaded extension or None: built at install (``mstar.models.kernels.build_all``) or
at first use, looked up once per process (``mstar.layers.cpu_build``), one warning when it cannot be
built, off with ``MSTAR_KERNELS=torch``. Every caller keeps a PyTorch path for None.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mstar.layers.cpu_build import CpuExtension

__all__ = ["build", "ops"]

log = logging.getLogger(__name__)

_EXTENSION = CpuExtension("qwen3_omni", ("moe.cpp", "code2wav.cpp", "module.cpp"), "Qwen3-Omni CPU kernels", log,
                          csrc=Path(__file__).with_name("csrc"))


def build(verbose: bool = False) -> Any:
    """Compile (or load the cached build of) the extension; raises when it cannot be built."""
    return _EXTENSION.build(verbose)


def ops() -> Any | None:
    """The loaded extension, or None (disabled, or the build failed: one warning, then silence)."""
    return _EXTENSION.get()
