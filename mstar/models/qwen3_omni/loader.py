"""Qwen3-Omni checkpoints (the hub layout transformers' ``save_pretrained`` writes) -> mstar modules.

One checkpoint directory holds ``config.json``, ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, and the tokenizer. Tensor names by component:

    thinker.model.{embed_tokens,layers.N,norm}.*, thinker.lm_head.weight      -> ThinkerLM
    talker.model.{codec_embedding,layers.N,norm}.*, talker.codec_head.weight,
    talker.{text,hidden}_projection.*                                         -> TalkerLM
    talker.code_predictor.{model.*,lm_head.J.weight}                          -> CodePredictor
    thinker.audio_tower.*, thinker.visual.*, code2wav.*                       (wrapped transformers modules)

Experts are stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) and fused here into
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]
(``fuse_expert_weights``); a checkpoint already in the fused layout is taken as it is. Only the
tensors of the component being built are read from the shards.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.layers.norms import RMSNorm
from mstar.layers.prepack import prepack_linears, prepack_requested
from mstar.model.checkpoint import CheckpointError, check_load_format, load_into
from mstar.models.llama.loader import checkpoint_files
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.talker import CodePredictor, TalkerLM
from mstar.models.qwen3_omni.thinker import ThinkerLM

__all__ = ["LOAD_FORMATS", "build_audio_tower", "build_code2wav", "build_code_predictor", "build_talker",
           "build_thinker", "build_vision_tower", "fuse_expert_weights", "hf_reference_model", "init_random",
           "read_prefixed",
           "read_rows", "tts_rows"]

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_EXPERT = re.compile(r"^(?P<block>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def read_prefixed(model_path: str | Path, prefix: str, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with ``prefix`` (and with none of ``skip``), named without it."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(prefix) and not name.startswith(skip):
                    out[name[len(prefix):]] = f.get_tensor(name)
    if not out:
        raise CheckpointError(f"{model_path}: no tensors named {prefix}* in the checkpoint")
    return out


def read_rows(model_path: str | Path, name: str, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of the 2-D tensor ``name``, read without loading the rest of it."""
    from safetensors import safe_open

    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if name in f.keys():
                table = f.get_slice(name)
                return torch.stack([table[r:r + 1][0] for r in rows])
    raise CheckpointError(f"{model_path}: no tensor {name} in the checkpoint")


def tts_rows(cfg: Qwen3OmniConfig, model_path: str | Path | None, load_format: str, seed: int = 0) -> torch.Tensor:
    """The thinker's input embeddings of ``tts_bos``, ``tts_eos``, ``tts_pad`` ``[3, H]`` (what the
    talker needs of the thinker's table); with dummy weights, the rows ``build_thinker`` draws."""
    ids = [cfg.tokens.tts_bos, cfg.tokens.tts_eos, cfg.tokens.tts_pad]
    if load_format == "dummy":
        return build_thinker(cfg, None, "dummy", seed=seed).model.embed_tokens.weight[ids].detach().clone()
    return read_rows(model_path, "thinker.model.embed_tokens.weight", ids)


def fuse_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down weights -> the fused in-memory layout (module docstring)."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups[m["block"]][int(m["e"])][m["proj"]] = t
    for block, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise CheckpointError(f"{block}: expert ids are not 0..{len(ids) - 1}")
        missing = [f"{block}.{e}.{p}_proj" for e in ids for p in ("gate", "up", "down") if p not in experts[e]]
        if missing:
            raise CheckpointError(f"{block}: missing {', '.join(missing[:5])}")
        out[f"{block}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in ids])
        out[f"{block}.down_proj"] = torch.stack([experts[e]["down"] for e in ids])
    return out


def init_random(module: nn.Module, seed: int) -> None:
    """Seeded random weights (std 0.02, the reference's initializer_range; biases 0, norms 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)


def _build(module: nn.Module, model_path: str | Path | None, load_format: str, prefix: str, seed: int,
           skip: tuple[str, ...] = ()) -> nn.Module:
    check_load_format(load_format, LOAD_FORMATS)
    if load_format == "dummy":
        init_random(module, seed)
    else:
        if model_path is None:
            raise ValueError("a Qwen3-Omni checkpoint needs a model path (or load_format='dummy')")
        state = fuse_expert_weights(read_prefixed(model_path, prefix, skip))
        load_into(module, state, what=f"{model_path} ({prefix}*)")
    if prepack_requested():  # projections, heads and norms through the compiled kernels (mstar.layers.prepack)
        prepack_linears(module)
    return module.eval()


def build_thinker(cfg: Qwen3OmniConfig, model_path: str | Path | None = None, load_format: str = "auto",
                  dtype: torch.dtype = torch.float32, seed: int = 0) -> ThinkerLM:
    module = ThinkerLM(cfg.thinker, dtype=dtype)
    skip = ("thinker.audio_tower.", "thinker.visual.", "thinker.model.audio_tower.", "thinker.model.visual.")
    return _build(module, model_path, load_format, "thinker.", seed, skip)  # type: ignore[return-value]


def build_talker(cfg: Qwen3OmniConfig, model_path: str | Path | None = None, load_format: str = "auto",
                 dtype: torch.dtype = torch.float32, seed: int = 1) -> TalkerLM:
    module = TalkerLM(cfg.talker, dtype=dtype)
    return _build(module, model_path, load_format, "talker.", seed,  # type: ignore[return-value]
                  ("talker.code_predictor.",))


def build_code_predictor(cfg: Qwen3OmniConfig, model_path: str | Path | None = None, load_format: str = "auto",
                         dtype: torch.dtype = torch.float32, seed: int = 2) -> CodePredictor:
    module = CodePredictor(cfg.talker.code_predictor, dtype=dtype)
    return _build(module, model_path, load_format, "talker.code_predictor.", seed)  # type: ignore[return-value]


def build_code2wav(cfg: Qwen3OmniConfig, model_path: str | Path | None = None, load_format: str = "auto",
                   seed: int = 3):
    """transformers' Code2Wav (wrapped by ``code2wav.Code2Wav``), from ``code2wav.*`` of the checkpoint or,
    with dummy weights, as transformers initialises it under ``seed``."""
    from mstar.models.qwen3_omni.code2wav import Code2Wav

    check_load_format(load_format, LOAD_FORMATS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = Code2Wav(dict(cfg.code2wav))
    if load_format != "dummy":
        module.load_weights(read_prefixed(model_path, "code2wav."), prefix="")
    return module.eval()


def build_audio_tower(cfg: Qwen3OmniConfig, model_path: str | Path | None = None, load_format: str = "auto",
                      seed: int = 4):
    """transformers' audio encoder (wrapped by ``encoders.AudioTower``), from ``thinker.audio_tower.*``."""
    from mstar.models.qwen3_omni.encoders import AudioTower

    check_load_format(load_format, LOAD_FORMATS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = AudioTower(dict(cfg.hf["thinker_config"]["audio_config"]))
    if load_format != "dummy":
        module.load_weights(read_prefixed(model_path, "thinker.audio_tower."), prefix="")
    return module.eval()


def build_vision_tower(cfg: Qwen3OmniConfig, model_path: str | Path | None = None, load_format: str = "auto",
                       seed: int = 5):
    """transformers' vision encoder (wrapped by ``encoders.VisionTower``), from ``thinker.visual.*``."""
    from mstar.models.qwen3_omni.encoders import VisionTower

    check_load_format(load_format, LOAD_FORMATS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = VisionTower(dict(cfg.hf["thinker_config"]["vision_config"]))
    if load_format != "dummy":
        module.load_weights(read_prefixed(model_path, "thinker.visual."), prefix="")
    return module.eval()


def hf_reference_model(hf_config: Mapping[str, Any], seed: int = 0):
    """transformers' ``Qwen3OmniMoeForConditionalGeneration`` with seeded random weights, every one of
    them initialised: the parity fixture of tests and benchmarks (``save_pretrained`` it, then load
    the directory here).

    transformers 5.24 initialises the thinker's MoE blocks but not the talker's: the talker's expert
    weights stay ``torch.empty`` (whatever memory held, sometimes 1e20 or NaN) and its routers zero
    (every expert tied). Those are drawn here, normal(0, initializer_range), after the model's own init.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeForConditionalGeneration(
        transformers.Qwen3OmniMoeConfig(**copy.deepcopy(dict(hf_config)))).eval()
    std = model.config.initializer_range
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.talker.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
