"""Loading BAGEL from its checkpoint directory (the ``ByteDance-Seed/BAGEL-7B-MoT`` layout)::

    llm_config.json    Qwen2 config of the language model
    vit_config.json    SigLIP config (BAGEL runs all layers but the last)
    ema.safetensors    language_model.*, time_embedder.*, vae2llm.*, llm2vae.*, latent_pos_embed.*,
                       vit_model.vision_model.* (linear patch embedding), connector.*, vit_pos_embed.*
    ae.safetensors     the FLUX autoencoder, BFL names (its geometry is read from the tensor shapes)
    tokenizer.json     Qwen2 tokenizer with <|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>

Each rank loads only the components of the nodes placed on it (a CFG-view rank reads only the LLM).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mstar.layers.llama import LlamaMLP
from mstar.layers.prepack import prepack_linears, prepack_requested
from mstar.model.checkpoint import CheckpointError, load_into, resolve_dtype
from mstar.models.bagel.config import BagelLLMConfig, BagelSpec
from mstar.models.bagel.nodes import BagelLLMNode, SpecialTokens
from mstar.models.bagel.vae import FLUX, BagelVAE, BagelVAEConfig
from mstar.models.bagel.vit import BagelViT, BagelViTConfig

__all__ = ["CheckpointError", "build_components", "load_spec", "load_tokenizer", "resolve_dtype",
           "vae_config_from_file"]

LLM_PREFIXES = ("language_model.", "time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed.")
VIT_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.")

def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing {path.name} in {str(path.parent)!r}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} must hold a JSON object")
    return data


def llm_config_from_json(data: dict[str, Any]) -> BagelLLMConfig:
    try:
        return BagelLLMConfig(
            vocab_size=int(data["vocab_size"]), hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]), num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=int(data["num_attention_heads"]),
            num_key_value_heads=int(data.get("num_key_value_heads", data["num_attention_heads"])),
            head_dim=data.get("head_dim"), rope_theta=float(data.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), qk_norm=True,
            max_position_embeddings=int(data.get("max_position_embeddings", 32768)))
    except KeyError as e:
        raise CheckpointError(f"llm_config.json lacks {e.args[0]!r}") from e


def vae_config_from_file(file: Path) -> BagelVAEConfig:
    """The autoencoder geometry of a BFL ``ae.safetensors``, read from its tensor shapes (only the
    header is read): block widths from ``encoder.down.{i}.block.0.conv1``, layers per block from the
    blocks of ``encoder.down.0``, latent channels from ``decoder.conv_in``. The latent scaling and
    shift stay FLUX's; GroupNorm's group count is not in the weights: 32 (FLUX's) whenever every
    width is a multiple of it, else the largest divisor of 32 that divides them all. The FLUX file
    gives exactly ``vae.FLUX``."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointError(f"{file.name} lacks {key!r} (cannot read the autoencoder geometry)")
        return shapes[key]

    first_block = re.compile(r"encoder\.down\.(\d+)\.block\.0\.conv1\.weight")
    levels = sorted(int(m[1]) for k in shapes if (m := first_block.fullmatch(k)))
    if not levels or levels != list(range(len(levels))):
        raise CheckpointError(f"{file.name}: encoder.down.{{i}}.block.0.conv1.weight must exist for "
                              f"i = 0, 1, ...; found levels {levels}")
    channels = tuple(shape(f"encoder.down.{i}.block.0.conv1.weight")[0] for i in levels)
    layers = 0
    while f"encoder.down.0.block.{layers}.conv1.weight" in shapes:
        layers += 1
    try:
        return replace(FLUX, block_out_channels=channels, layers_per_block=layers,
                       latent_channels=shape("decoder.conv_in.weight")[1],
                       in_channels=shape("encoder.conv_in.weight")[1],
                       out_channels=shape("decoder.conv_out.weight")[0],
                       norm_num_groups=math.gcd(32, *channels))
    except ValueError as e:
        raise CheckpointError(f"{file.name}: unusable autoencoder geometry: {e}") from e


def load_spec(model_path: str | Path) -> BagelSpec:
    """The ``BagelSpec`` of a checkpoint directory (the reference's fixed settings: latent patch 2,
    64 latent cells per side, 70 ViT patches per side; the autoencoder as ``ae.safetensors`` shapes
    it, FLUX's when the file is absent, e.g. on a rank that hosts only the LLM; the image transforms
    sized from the ViT's patch and image size and the autoencoder's downsampling:
    ``BagelSpec.from_checkpoint_parts``)."""
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} does not exist or is not a directory")
    llm = llm_config_from_json(_json(path / "llm_config.json"))
    vit = BagelViTConfig.from_json(_json(path / "vit_config.json"), llm_hidden=llm.hidden_size)
    ae = path / "ae.safetensors"
    try:
        return BagelSpec.from_checkpoint_parts(llm, vit, vae_config_from_file(ae) if ae.is_file() else FLUX)
    except ValueError as e:
        raise CheckpointError(f"{str(path)!r}: {e}") from e


def load_tokenizer(model_path: str | Path | None):
    from mstar.models.llama.tokenizer import HFTokenizer

    if model_path is None:
        raise CheckpointError("no model path to read tokenizer.json from")
    f = Path(model_path) / "tokenizer.json"
    if not f.is_file():
        raise CheckpointError(f"no tokenizer.json in {str(model_path)!r}")
    tok = HFTokenizer(f)
    eos = tok.token_to_id("<|im_end|>")
    tok.eos_token_ids = (eos,) if eos is not None else ()
    return tok


def _read_prefixed(file: Path, prefixes: tuple[str, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointError(f"missing {file.name} in {str(file.parent)!r}")
    out = {}
    with safe_open(str(file), framework="pt") as f:
        for k in f.keys():
            if k.startswith(prefixes):
                t = f.get_tensor(k)
                out[k] = t.to(dtype) if t.is_floating_point() else t
    return out


def build_components(spec: BagelSpec, need: Iterable[str], tokens: SpecialTokens, *, model_path: str | None,
                     load_format: str, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """The weight-holding components the listed base nodes need: ``LLM`` (BagelLLMNode), ``vit``
    (BagelViT), ``vae`` (BagelVAE). Dummy weights are seeded per component, so every rank builds the
    same values whatever it hosts."""
    need = set(need)
    out: dict[str, Any] = {}
    dummy = load_format == "dummy"
    path = Path(model_path) if model_path is not None else None
    if "LLM" in need:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            llm = BagelLLMNode(spec.llm, spec.latent_dim, spec.max_latent_size, tokens, dtype=dtype)
        if not dummy:
            load_into(llm, _read_prefixed(path / "ema.safetensors", LLM_PREFIXES, dtype),
                      what="ema.safetensors (LLM)")
        if prepack_requested():  # projections through the panel kernel: a row's result is the same in any batch
            for sub in llm.modules():
                if isinstance(sub, LlamaMLP):
                    sub.pack_weights()  # gate/up as one weight: prepacked with the SiLU-mul fused
            prepack_linears(llm)
        out["LLM"] = llm.eval()
    if "vit_encoder" in need:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            vit = BagelViT(spec.vit, dtype=dtype)
        if not dummy:
            load_into(vit, _read_prefixed(path / "ema.safetensors", VIT_PREFIXES, dtype),
                      what="ema.safetensors (ViT)")
        if prepack_requested():
            prepack_linears(vit)
        out["vit"] = vit.eval()
    if need & {"vae_encoder", "vae_decoder"}:
        if dummy:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 2)
                vae = BagelVAE(spec.vae, dtype=None if dtype == torch.float32 else dtype)
        else:
            f = path / "ae.safetensors"
            if not f.is_file():
                raise CheckpointError(f"missing ae.safetensors in {str(path)!r}")
            try:
                vae = BagelVAE.from_bfl_file(f, spec.vae, dtype=None if dtype == torch.float32 else dtype)
            except (ValueError, RuntimeError) as e:  # missing/unexpected keys, wrong shapes
                raise CheckpointError(f"ae.safetensors does not match the autoencoder: {e}") from e
        out["vae"] = vae.eval()
    return out
