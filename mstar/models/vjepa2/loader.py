"""Load V-JEPA 2-AC weights: Meta's ``vjepa2-ac-vitg.pt`` (a torch pickle) or deterministic dummy values.

The checkpoint is a dict with ``encoder`` and ``predictor`` state dicts whose keys carry DDP / wrapper
prefixes (``module.backbone.blocks.0.attn.qkv.weight``); stripping leading ``module.`` and ``backbone.``
gives the names of ``VJepaEncoder`` / ``ACPredictor`` parameters one for one. It is read with
``torch.load(weights_only=True)``: only tensors and plain containers are unpickled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.model.checkpoint import CheckpointError, CheckpointNotFoundError, listed, load_into
from mstar.models.vjepa2.config import TINY_ENCODER, TINY_PREDICTOR, EncoderConfig, PredictorConfig
from mstar.models.vjepa2.encoder import VJepaEncoder
from mstar.models.vjepa2.predictor import ACPredictor

__all__ = [
    "PREFIXES",
    "build_vjepa2_ac",
    "dummy_vjepa2",
    "init_random_weights",
    "load_into",
    "load_vjepa2_ac",
    "strip_prefixes",
]

PREFIXES = ("module.", "backbone.")
def strip_prefixes(state: Mapping[str, torch.Tensor], prefixes: Iterable[str] = PREFIXES) -> dict[str, torch.Tensor]:
    """Drop any run of leading ``prefixes`` from every key (``module.backbone.x`` -> ``x``)."""
    prefixes = tuple(prefixes)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key
        while True:
            for p in prefixes:
                if name.startswith(p):
                    name = name[len(p):]
                    break
            else:
                break
        if name in out:
            raise CheckpointError(f"two checkpoint keys map to {name!r} after stripping {prefixes}")
        out[name] = value
    return out


def load_vjepa2_ac(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read ``(encoder_state, predictor_state)`` from a V-JEPA 2-AC checkpoint, prefixes stripped."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: V-JEPA 2-AC checkpoint not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise CheckpointError(f"{path}: cannot read as a torch checkpoint (weights_only): {e}") from e
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(f"{path}: expected a dict with 'encoder' and 'predictor', got {type(ckpt).__name__}")
    states = []
    for part in ("encoder", "predictor"):
        sd = ckpt.get(part)
        if not isinstance(sd, Mapping):
            raise CheckpointError(f"{path}: no '{part}' state dict (top-level keys: {listed(sorted(ckpt))})")
        bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"{path}: '{part}' entries that are not tensors: {listed(bad)}")
        states.append(strip_prefixes(sd))
    return states[0], states[1]


def build_vjepa2_ac(
    path: str | Path,
    encoder_config: EncoderConfig | None = None,
    predictor_config: PredictorConfig | None = None,
) -> tuple[VJepaEncoder, ACPredictor]:
    """Build the real-size encoder and predictor (ViT-g + AC predictor by default) from a checkpoint."""
    from mstar.models.vjepa2.config import AC_PREDICTOR, VITG_ENCODER

    enc_state, pred_state = load_vjepa2_ac(path)
    encoder = VJepaEncoder(encoder_config or VITG_ENCODER)
    predictor = ACPredictor(predictor_config or AC_PREDICTOR)
    load_into(encoder, enc_state, what=f"{path} [encoder]")
    load_into(predictor, pred_state, what=f"{path} [predictor]")
    return encoder.eval(), predictor.eval()


def init_random_weights(module: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter from a seeded generator with values that keep activations O(1).

    Matrices / conv kernels: N(0, 1/fan_in); LayerNorm weights: 1 + N(0, 0.1); other vectors: N(0, 0.1).
    Parameters are visited in sorted-name order, so two modules with the same names get the same values.
    """
    gen = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                value = noise / math.sqrt(p[0].numel())
            elif name.endswith("weight"):  # LayerNorm scale
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            p.copy_(value.to(p.dtype))
    return module


def dummy_vjepa2(
    seed: int = 0,
    encoder_config: EncoderConfig = TINY_ENCODER,
    predictor_config: PredictorConfig = TINY_PREDICTOR,
) -> tuple[VJepaEncoder, ACPredictor]:
    """Tiny encoder + predictor (by default) with deterministic random weights, in eval mode."""
    encoder = init_random_weights(VJepaEncoder(encoder_config), seed)
    predictor = init_random_weights(ACPredictor(predictor_config), seed + 1)
    return encoder.eval(), predictor.eval()


# -- the Hugging Face layout of the encoder (transformers.VJEPA2Model: config.json + model.safetensors) --
def _hf_encoder_state(hf: Mapping[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """HF names -> ours: separate query/key/value become one fused ``qkv`` (rows q, k, v)."""
    out: dict[str, torch.Tensor] = {}
    pre = "encoder."
    for name, t in hf.items():
        if not name.startswith(pre):
            continue
        n = name[len(pre):]
        if n.startswith("embeddings.patch_embeddings."):
            out["patch_embed." + n[len("embeddings.patch_embeddings."):]] = t
        elif n.startswith("layernorm."):
            out["norm." + n[len("layernorm."):]] = t
        elif n.startswith("layer."):
            i, rest = n[len("layer."):].split(".", 1)
            if rest.startswith("attention.") and rest.split(".")[1] in ("query", "key", "value"):
                continue  # fused below
            out[f"blocks.{i}.{rest.replace('attention.', 'attn.', 1)}"] = t
    for i in range(depth):
        for kind in ("weight", "bias"):
            parts = [hf.get(f"{pre}layer.{i}.attention.{p}.{kind}") for p in ("query", "key", "value")]
            if all(p is not None for p in parts):
                out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts, 0)
    return out


def encoder_config_from_hf(config: Mapping[str, Any]) -> EncoderConfig:
    size = config.get("crop_size", 256)
    return EncoderConfig(img_size=(size, size), patch_size=config.get("patch_size", 16),
                         tubelet_size=config.get("tubelet_size", 2), in_chans=config.get("in_chans", 3),
                         embed_dim=config["hidden_size"], depth=config["num_hidden_layers"],
                         num_heads=config["num_attention_heads"], mlp_ratio=config.get("mlp_ratio", 4.0),
                         qkv_bias=config.get("qkv_bias", True), layernorm_eps=config.get("layer_norm_eps", 1e-6))


def load_hf_encoder(path: str | Path) -> VJepaEncoder:
    """Our encoder from a Hugging Face ``VJEPA2Model`` directory (config.json + model.safetensors)."""
    import json

    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise CheckpointNotFoundError(f"V-JEPA 2 HF encoder: {f} not found")
    config = encoder_config_from_hf(json.loads(cfg_file.read_text()))
    encoder = VJepaEncoder(config)
    load_into(encoder, _hf_encoder_state(load_file(str(weights)), config.depth), what=f"encoder in {path}")
    return encoder.eval()
