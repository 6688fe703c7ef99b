"""Import Meta's V-JEPA 2 reference code (PyPI ``cc-vjepa2``, installed with ``pip install --no-deps``).

The reference's only use of timm is ``from timm.models.layers import drop_path`` (stochastic depth, a no-op
in eval). timm would pull torchvision, which this project does not install, so a minimal stand-in for
``timm`` / ``timm.models`` / ``timm.models.layers`` is put into ``sys.modules`` before the import -- only
when timm itself is not importable. Tests call ``reference()``; it skips them when cc-vjepa2 is absent.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest

SKIP_REASON = "cc-vjepa2 not installed (reference for V-JEPA 2-AC parity): pip install --no-deps cc-vjepa2"


def _drop_path(x: Any, drop_prob: float = 0.0, training: bool = False) -> Any:
    if not training or not drop_prob:
        return x
    raise NotImplementedError("timm stand-in: drop_path is only supported in eval / with drop_prob 0")


def _install_timm_stub() -> None:
    if "timm.models.layers" in sys.modules:
        return
    if importlib.util.find_spec("timm") is not None:
        return  # the real timm is there: let the reference use it
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    layers.drop_path = _drop_path  # type: ignore[attr-defined]
    timm.models = models  # type: ignore[attr-defined]
    models.layers = layers  # type: ignore[attr-defined]
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


def reference() -> types.SimpleNamespace:
    """``ns.VisionTransformerPredictorAC``, ``ns.VisionTransformer``, ``ns.modules`` (vjepa2.models.utils.modules)."""
    if importlib.util.find_spec("vjepa2") is None:
        pytest.skip(SKIP_REASON)
    _install_timm_stub()
    # imported at module import time by these: vjepa2.utils.tensors, vjepa2.masks.utils,
    # vjepa2.models.utils.{modules,patch_embed,pos_embs} (torch, numpy, einops only)
    from vjepa2.models import ac_predictor, vision_transformer
    from vjepa2.models.utils import modules

    return types.SimpleNamespace(
        VisionTransformerPredictorAC=ac_predictor.VisionTransformerPredictorAC,
        VisionTransformer=vision_transformer.VisionTransformer,
        modules=modules,
    )
