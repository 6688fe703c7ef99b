"""Loading pi0.5 from a lerobot checkpoint directory (the ``lerobot/pi05_base`` layout)::

    config.json         lerobot's PI05Config (type "pi05"; variants, chunk_size, image_resolution, ...)
    model.safetensors   the weights, keys WITHOUT lerobot's ``model.`` prefix

Key handling, as lerobot's loader does it:

* ``paligemma_with_expert.paligemma.lm_head.weight`` is the tied text embedding; the file has no
  ``language_model.embed_tokens.weight``, so the prefix's ``embed_tokens`` is taken from it;
* ``paligemma_with_expert.gemma_expert.lm_head.weight`` (the expert's unused LM head) is dropped;
* ``action_time_mlp_{in,out}`` (older files) are the pi0.5 ``time_mlp_{in,out}``; a ``model.``
  prefix, where a file has one, is removed.

Each rank reads only the tensors of the components placed on it (``vision`` or the LLM module).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mstar.layers.prepack import prepack_linears, prepack_requested
from mstar.model.checkpoint import CheckpointError, CheckpointNotFoundError, mismatch_report
from mstar.models.pi05.config import PI05_BASE, Pi05Config, VisionConfig
from mstar.models.pi05.nodes import Pi05LLMNode
from mstar.models.pi05.vision import Pi05Vision

__all__ = ["LLM", "VISION", "build_components", "canonical_key", "config_from_json", "llm_key", "load_component",
           "vision_key"]

VISION, LLM = "vision", "llm"  # the two weight-holding components
_PG = "paligemma_with_expert.paligemma."
_EXPERT = "paligemma_with_expert.gemma_expert."
_EMBED = _PG + "model.language_model.embed_tokens.weight"
_LM_HEAD = _PG + "lm_head.weight"
_DROPPED = (_EXPERT + "lm_head.weight",)
_TOP_LEVEL = ("action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.")
_RENAMED = {"action_time_mlp_in.": "time_mlp_in.", "action_time_mlp_out.": "time_mlp_out."}


def canonical_key(key: str) -> str:
    """A checkpoint key in pi0.5's own naming: no ``model.`` prefix, pi0.5's ``time_mlp`` names."""
    key = key.removeprefix("model.")
    for old, new in _RENAMED.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def vision_key(key: str) -> str | None:
    """The ``Pi05Vision`` parameter a canonical checkpoint key loads into (None: not a vision key)."""
    for part in ("vision_tower.", "multi_modal_projector."):
        if key.startswith(_PG + "model." + part):
            return key[len(_PG + "model."):]
    return None


def llm_key(key: str) -> str | None:
    """The ``Pi05LLMNode`` parameter a canonical checkpoint key loads into (None: not an LLM key)."""
    if key == _LM_HEAD:
        return "prefix.embed_tokens.weight"
    if key.startswith(_PG + "model.language_model."):
        return "prefix." + key[len(_PG + "model.language_model."):]
    if key.startswith(_EXPERT + "model."):
        return "expert." + key[len(_EXPERT + "model."):]
    if key.startswith(_TOP_LEVEL):
        return "expert." + key
    return None


def _owner(key: str) -> str | None:
    if key in _DROPPED or key == _EMBED:  # the embedding comes from lm_head (tied); see the docstring
        return None
    if vision_key(key) is not None:
        return VISION
    if llm_key(key) is not None:
        return LLM
    raise CheckpointError(f"model.safetensors: unexpected key {key!r} (not a pi0.5 weight)")


def _component_keys(keys: Iterable[str], component: str) -> dict[str, str]:
    """Module name -> file key of one component's tensors. Every key of the file must belong to some
    component (a stray key is a ``CheckpointError``)."""
    canon = {canonical_key(k): k for k in keys}
    rename = vision_key if component == VISION else llm_key
    names = {rename(key): raw for key, raw in canon.items() if _owner(key) == component}
    if component == LLM and _LM_HEAD not in canon and _EMBED in canon:
        names["prefix.embed_tokens.weight"] = canon[_EMBED]
    return names


def load_component(module: torch.nn.Module, file: Path, component: str) -> None:
    """Copy one component's tensors from ``model.safetensors`` into ``module``, one tensor at a time
    (the file is never held in memory at once). Names and shapes are checked against the file's
    header first: every mismatch is reported in one ``CheckpointError`` before anything is copied."""
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointNotFoundError(f"missing {file.name} in {str(file.parent)!r}")
    expected = module.state_dict()
    with safe_open(str(file), framework="pt") as f:
        names = _component_keys(f.keys(), component)
        shapes = {n: tuple(f.get_slice(raw).get_shape()) for n, raw in names.items()}
        bad = [f"{n} (checkpoint {shapes[n]}, model {tuple(v.shape)})"
               for n, v in expected.items() if n in shapes and shapes[n] != tuple(v.shape)]
        report = mismatch_report([("missing", [n for n in expected if n not in names]),
                                  ("unexpected", [n for n in names if n not in expected]), ("shape mismatch", bad)])
        if report:
            raise CheckpointError(f"model.safetensors ({component}) does not fit {type(module).__name__}: {report}")
        with torch.no_grad():
            for n, v in expected.items():
                v.copy_(f.get_tensor(names[n]).to(v.dtype))


def config_from_json(path: Path, base: Pi05Config = PI05_BASE) -> Pi05Config:
    """``base`` with the settings a lerobot ``config.json`` may change: horizon, action dim, flow steps,
    image size and prompt length. The architecture itself is implied by the variant names."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path.name}: {e}") from e
    if not isinstance(data, dict) or data.get("type", "pi05") != "pi05":
        raise CheckpointError(f"{path.name}: not a pi0.5 config (type {data.get('type')!r})")
    for field, want in (("paligemma_variant", "gemma_2b"), ("action_expert_variant", "gemma_300m")):
        if data.get(field, want) != want:
            raise CheckpointError(f"{path.name}: {field} {data[field]!r} is not supported (only {want!r})")
    _check_normalization(data.get("normalization_mapping"), path.name)
    res = data.get("image_resolution", [base.vision.image_size] * 2)
    if not isinstance(res, list) or len(res) != 2 or res[0] != res[1]:
        raise CheckpointError(f"{path.name}: image_resolution must be square, got {res!r}")
    try:
        vision: VisionConfig = replace(base.vision, image_size=int(res[0]))
        return replace(base, vision=vision, horizon=int(data.get("chunk_size", base.horizon)),
                       action_dim=int(data.get("max_action_dim", base.action_dim)),
                       num_steps=int(data.get("num_inference_steps", base.num_steps)),
                       max_text_tokens=int(data.get("tokenizer_max_length", base.max_text_tokens)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path.name}: {e}") from e


# How pi0.5 normalises each feature kind (lerobot's PI05Config default); the only modes served:
# images go in as [-1, 1] pixels, the state and actions through the checkpoint's quantile statistics
SERVED_NORMALIZATION = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}


def _check_normalization(mapping: Any, source: str) -> None:
    """A ``normalization_mapping`` other than ``SERVED_NORMALIZATION`` (e.g. a fine-tune with
    ``STATE: MEAN_STD``) is refused: served with quantiles its states and actions would be wrong."""
    if mapping is None:
        return
    if not isinstance(mapping, dict):
        raise CheckpointError(f"{source}: normalization_mapping must be an object, got {mapping!r}")
    bad = [f"{kind}: {mode}" for kind, mode in mapping.items()
           if kind in SERVED_NORMALIZATION and str(mode).upper() != SERVED_NORMALIZATION[kind]]
    if bad:
        served = ", ".join(f"{k}: {v}" for k, v in SERVED_NORMALIZATION.items())
        raise CheckpointError(f"{source}: normalization_mapping {', '.join(bad)} is not supported "
                              f"(served: {served})")


def _dummy_init(module: torch.nn.Module, seed: int) -> None:
    """Seeded random weights that exercise every term: non-zero adaRMS projections and norm offsets,
    LayerNorm gains near 1, matrices scaled by their fan-in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mname, m in module.named_modules():
            for name, p in m.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=g)
                if isinstance(m, torch.nn.LayerNorm) and name == "weight":
                    p.copy_(1 + 0.1 * noise)
                elif p.dim() < 2:
                    p.copy_(noise * (0.1 if name == "weight" else 0.02))
                elif mname.endswith("dense"):  # adaRMS (scale, shift, gate): small, as trained ones are
                    p.copy_(noise * 0.02)
                else:
                    p.copy_(noise * p[0].numel() ** -0.5)


def _new(name: str, cfg: Pi05Config, dtype: torch.dtype) -> torch.nn.Module:
    """An unfilled component: the LLM module is laid out on the meta device and given storage
    without running any initialiser (the loader or ``_dummy_init`` writes every parameter)."""
    if name == VISION:  # transformers' SigLIP keeps buffers its constructor fills: build it normally
        return Pi05Vision(cfg.vision, cfg.prefix.width).to(dtype)
    with torch.device("meta"):
        module = Pi05LLMNode(cfg, dtype)
    return module.to_empty(device="cpu").to(dtype)


def build_components(cfg: Pi05Config, need: Iterable[str], *, model_path: str | None, load_format: str,
                     dtype: torch.dtype, seed: int, prepack: bool | None = False) -> dict[str, torch.nn.Module]:
    """The weight-holding components asked for: ``VISION`` (``Pi05Vision``) and ``LLM``
    (``Pi05LLMNode``). Dummy weights are seeded per component, so every rank builds the same.
    ``prepack`` (None: unless ``MSTAR_PREPACK=0``): the LLM module's projections are then prepacked
    once loaded (``mstar.layers.prepack``: ~1e-5 relative from the plain path, a second copy)."""
    file = Path(model_path) / "model.safetensors" if model_path is not None else None
    out: dict[str, torch.nn.Module] = {}
    for name, offset in ((VISION, 1), (LLM, 0)):
        if name not in set(need):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + offset)
            module = _new(name, cfg, dtype)
        if load_format == "dummy":
            _dummy_init(module, seed + offset)
        else:
            load_component(module, file, name)
        if name == LLM and prepack_requested(prepack):
            prepack_linears(module)
        out[name] = module.eval()
    return out
