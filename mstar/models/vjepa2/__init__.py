"""V-JEPA 2-AC world model: ViT-g video encoder + action-conditioned predictor (full and KV-cached rollout)."""

from mstar.models.vjepa2.config import (
    AC_PREDICTOR,
    TINY_ENCODER,
    TINY_PREDICTOR,
    VITG_ENCODER,
    EncoderConfig,
    PredictorConfig,
)
from mstar.models.vjepa2.loader import build_vjepa2_ac, dummy_vjepa2, load_into, load_vjepa2_ac
from mstar.models.vjepa2.modules import (
    ACPredictor,
    FrameKVCache,
    KVLayer,
    VJepaEncoder,
    block_append_attention,
    encode_frames,
)

__all__ = [
    "AC_PREDICTOR",
    "TINY_ENCODER",
    "TINY_PREDICTOR",
    "VITG_ENCODER",
    "ACPredictor",
    "EncoderConfig",
    "FrameKVCache",
    "KVLayer",
    "PredictorConfig",
    "VJepaEncoder",
    "block_append_attention",
    "build_vjepa2_ac",
    "dummy_vjepa2",
    "encode_frames",
    "load_into",
    "load_vjepa2_ac",
]
