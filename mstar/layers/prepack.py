"""Prepacked linear layers: weights reordered once into oneDNN's blocked layout (as inductor's
weight freezing does), so a CPU matrix multiply skips re-laying the weight out at every call.

``prepack_linears(module)`` is a transform of a built model (in the spirit of gpt-fast's
``apply_tp``): every submodule with a ``prepack()`` method (the Llama attention and MLP blocks, the
LLM node's head) prepacks its projections and uses them from then on. Each prepacked weight
remembers the tensor it was packed from and that tensor's version counter, so a module whose
weights were changed afterwards (an in-place copy, a replaced parameter) goes back to the plain
path instead of using stale values. Only float32 CPU weights are prepacked; without PyTorch's
oneDNN ops nothing changes. The packed copy doubles the memory of the projection weights.

Off by default; the Llama loader applies it with ``prepack=True`` or ``MSTAR_PREPACK=1``. Results
agree with ``x @ W`` to ~1e-5 relative, not bitwise: on SmolLM2-135M (30 layers) prefill logits
move 1.3e-4 from transformers' (the plain path stays within its 1e-4 test bound). Neither path is
bitwise batch invariant per row on this CPU (a row alone and in a batch of 16 may round
differently), so with or without it batch invariance is a property of greedy tokens, not of
logits' bits.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

__all__ = ["PrepackedLinear", "can_prepack", "prepack_available", "prepack_linears", "prepack_requested"]

log = logging.getLogger(__name__)

# oneDNN picks the packed layout for this many rows; any batch works. 16 (a full decode batch) was
# as fast as no hint or 1 at batch 1 and faster at batch 16 (2-core AVX-512 machine).
BATCH_HINT = 16


def prepack_available() -> bool:
    """PyTorch has the oneDNN linear ops (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepack_requested(flag: bool | None = None) -> bool:
    """Whether a loader should prepack: ``flag`` when given, else ``MSTAR_PREPACK=1`` (off by default:
    see the module docstring)."""
    if flag is not None:
        return flag
    return os.environ.get("MSTAR_PREPACK", "0").strip().lower() in ("1", "true", "yes", "on")


class PrepackedLinear:
    """``x @ W.T`` for a weight ``W`` ``[out, in]`` (nn.Linear's layout; ``in_out=True``: ``source``
    is stored ``[in, out]`` and computes ``x @ source``) through a oneDNN-prepacked copy of it."""

    def __init__(self, source: torch.Tensor, *, in_out: bool = False) -> None:
        self.source = source
        self.version = source._version
        with torch.no_grad():
            out_in = (source.detach().t() if in_out else source.detach()).contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(out_in, BATCH_HINT)

    def fresh(self, source: torch.Tensor | None) -> bool:
        """Packed from this very tensor, which has not changed since (same version)."""
        return source is self.source and source._version == self.version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, x.shape[-1]).contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def can_prepack(*weights: torch.Tensor | None) -> bool:
    """Every weight is a float32 CPU tensor (what the oneDNN path is used for here)."""
    return all(w is not None and w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)


def prepack_linears(module: nn.Module) -> int:
    """Prepack the projections of every submodule of ``module`` that has a ``prepack()`` method;
    returns how many did (0 without the oneDNN ops: the plain path is kept)."""
    if not prepack_available():
        return 0
    count = 0
    try:
        for sub in module.modules():
            prepack = getattr(sub, "prepack", None)
            if callable(prepack) and prepack():
                count += 1
    except RuntimeError as exc:  # a oneDNN build that cannot pack these shapes: keep the plain path
        log.warning("prepacked linears unavailable, using plain matrix multiplies (%s)", exc)
        for sub in module.modules():
            if hasattr(sub, "prepack"):
                sub.prepacked = None
        return 0
    return count
