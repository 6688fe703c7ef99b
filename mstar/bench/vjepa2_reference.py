"""Meta's V-JEPA 2 reference code (PyPI ``cc-vjepa2``, installed with ``pip install --no-deps``), for
parity tests and side-by-side benchmarks.

The reference's only use of timm is ``from timm.models.layers import drop_path`` (stochastic depth, the
identity at inference). timm would pull torchvision, which this project does not install, so a
minimal stand-in for ``timm`` / ``timm.models`` / ``timm.models.layers`` is put into ``sys.modules``
for the import (and taken out after it) -- only when timm itself is not importable.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

INSTALL_HINT = "cc-vjepa2 is not installed: pip install --no-deps cc-vjepa2"


def _drop_path(x: Any, drop_prob: float = 0.0, training: bool = False) -> Any:
    if not training or not drop_prob:
        return x
    raise NotImplementedError("timm stand-in: drop_path is only supported in eval / with drop_prob 0")


def _install_timm_stub() -> list[str]:
    """The stand-in's module names put into ``sys.modules`` (none when timm is importable)."""
    if "timm.models.layers" in sys.modules or importlib.util.find_spec("timm") is not None:
        return []  # already there, or the real timm is installed: let the reference use it
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    layers.drop_path = _drop_path  # type: ignore[attr-defined]
    timm.models = models  # type: ignore[attr-defined]
    models.layers = layers  # type: ignore[attr-defined]
    stand_ins = {"timm": timm, "timm.models": models, "timm.models.layers": layers}
    sys.modules.update(stand_ins)
    return list(stand_ins)


def import_reference() -> types.SimpleNamespace:
    """``ns.VisionTransformerPredictorAC``, ``ns.VisionTransformer``, ``ns.modules``; ImportError if absent."""
    if importlib.util.find_spec("vjepa2") is None:
        raise ImportError(INSTALL_HINT)
    installed = _install_timm_stub()
    try:
        from vjepa2.models import ac_predictor, vision_transformer
        from vjepa2.models.utils import modules
    finally:  # only for the import: a stand-in left in sys.modules (no __spec__) broke later
        for name in installed:  # importlib.util.find_spec("timm") calls, diffusers' import among them
            sys.modules.pop(name, None)

    return types.SimpleNamespace(VisionTransformerPredictorAC=ac_predictor.VisionTransformerPredictorAC,
                                 VisionTransformer=vision_transformer.VisionTransformer, modules=modules)


def reference_predictor(cfg, max_frames: int):
    """The reference ``VisionTransformerPredictorAC`` with the shape of our ``PredictorConfig``."""
    ref = import_reference()
    return ref.VisionTransformerPredictorAC(
        img_size=cfg.img_size, patch_size=cfg.patch_size, num_frames=max_frames * cfg.tubelet_size,
        tubelet_size=cfg.tubelet_size, embed_dim=cfg.embed_dim, predictor_embed_dim=cfg.predictor_embed_dim,
        depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, qkv_bias=cfg.qkv_bias,
        use_silu=cfg.use_silu, wide_silu=cfg.wide_silu, use_rope=True, is_frame_causal=True,
        action_embed_dim=cfg.action_dim, use_extrinsics=cfg.use_extrinsics).eval()
