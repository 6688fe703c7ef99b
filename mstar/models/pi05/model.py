"""``Pi05Model``: pi0.5 served as the walks of ``graph.py`` with the nodes of ``nodes.py``;
``Pi05Tiny``, its offline twin (the parity fixture's sizes, seeded random weights).

Runtime-level request (``Runtime.submit`` / native ``/generate``): the fields of
``config.Pi05Request`` as inputs ``images`` [n_cam, 3, H, W] float in [-1, 1], ``image_masks``
[n_cam] bool, ``token_ids`` [L] int, ``token_mask`` [L] bool (optional), ``noise`` [horizon,
action_dim] (optional), and the parameter ``seed`` (the noise seed when no noise is given).
The request emits one item, ``actions``: float32 [horizon, action_dim].
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.graph import WalkGraph
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.model.checkpoint import (
    CheckpointNotFoundError,
    check_load_format,
    reject_checkpoint,
    resolve_dtype,
)
from mstar.model.validation import check_int
from mstar.models.pi05 import graph as pi05_graph
from mstar.models.pi05.config import PI05_BASE, PI05_TINY, Pi05Config, Pi05Request
from mstar.models.pi05.request import Pi05Params

__all__ = ["Pi05Model", "Pi05Tiny", "validate_request"]

_INPUTS = frozenset({"images", "image_masks", "token_ids", "token_mask", "noise"})
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_images(r: Pi05Request, cfg: Pi05Config) -> int:
    s, n_max = cfg.vision.image_size, cfg.max_cameras
    im = r.images
    if not isinstance(im, torch.Tensor) or im.dim() != 4 or tuple(im.shape[1:]) != (3, s, s):
        got = list(im.shape) if isinstance(im, torch.Tensor) else type(im).__name__
        raise ValueError(f"pi05: images must be a float tensor [n_cam, 3, {s}, {s}], got {got}")
    if not 1 <= im.shape[0] <= n_max:
        raise ValueError(f"pi05: 1 to {n_max} cameras per request, got {im.shape[0]}")
    if not im.is_floating_point() or not bool(torch.isfinite(im).all()):
        raise ValueError("pi05: images must be finite floats in [-1, 1]")
    m = r.image_masks
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (im.shape[0],):
        raise ValueError(f"pi05: image_masks must be a bool tensor [{im.shape[0]}] (one per camera)")
    if not bool(m.any()):
        raise ValueError("pi05: at least one camera must be valid (image_masks all False)")
    return int(m.sum())


def _check_tokens(r: Pi05Request, cfg: Pi05Config) -> int:
    ids = r.token_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in _INT_DTYPES:
        raise ValueError("pi05: token_ids must be a 1-D integer tensor")
    if not 1 <= ids.numel() <= cfg.max_text_tokens:
        raise ValueError(f"pi05: 1 to {cfg.max_text_tokens} token ids, got {ids.numel()}")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"pi05: token ids must be in [0, {cfg.vocab_size})")
    mask = r.token_mask
    if mask is None:
        return ids.numel()
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"pi05: token_mask must be a bool tensor [{ids.numel()}] like token_ids")
    return int(mask.sum())


def validate_request(r: Pi05Request, cfg: Pi05Config) -> int:
    """Raise ``ValueError`` for a request the model cannot take; return its prefix length (tokens)."""
    cams = _check_images(r, cfg)
    text = _check_tokens(r, cfg)
    if r.noise is not None:
        want = (cfg.horizon, cfg.action_dim)
        if (not isinstance(r.noise, torch.Tensor) or tuple(r.noise.shape) != want or not r.noise.is_floating_point()
                or not bool(torch.isfinite(r.noise).all())):
            raise ValueError(f"pi05: noise must be finite floats [{want[0]}, {want[1]}]")
    if r.seed is not None:
        check_int(r.seed, "pi05: seed", lo=0, hi=2**63 - 1)
    return cams * cfg.vision.tokens_per_image + text


class Pi05Model(ModelDef):
    """A lerobot pi0.5 checkpoint directory (``model_path``: ``model.safetensors``, optionally
    ``config.json``) or, with ``load_format="dummy"``, seeded random weights."""

    checks_params = True  # parse_request looks up every params key (Runtime.submit refuses others)
    request_type = Pi05Params

    name = "pi05"
    family = "pi05"
    views = {"expert": "prefix"}

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto",
                 dtype: str | torch.dtype = "float32", config: Pi05Config | None = None, seed: int = 0,
                 prepack: bool | None = None) -> None:
        check_load_format(load_format)
        self.prepack = prepack  # prepacked projections (None: yes, unless MSTAR_PREPACK=0)
        if load_format != "dummy" and model_path is None:
            raise ValueError("pi05 needs --model-path (a lerobot pi05 checkpoint directory); or serve pi05-tiny")
        self.model_path = str(model_path) if model_path is not None else None
        self.load_format, self.dtype, self.seed = load_format, resolve_dtype(dtype), seed
        self._config = config

    @property
    def config(self) -> Pi05Config:
        """The explicit config, else the checkpoint's ``config.json`` over ``PI05_BASE``."""
        if self._config is None:
            from mstar.models.pi05.loader import config_from_json

            f = Path(self.model_path) / "config.json" if self.model_path else None
            self._config = config_from_json(f) if f is not None and f.is_file() else PI05_BASE
        return self._config

    def preflight(self) -> None:
        if self.load_format == "dummy":
            return
        path = Path(self.model_path)
        if not (path / "model.safetensors").is_file():
            raise CheckpointNotFoundError(f"pi05: no model.safetensors in {str(path)!r}")
        self.config  # noqa: B018 - parses config.json (a clear error before any worker starts)

    def build_graph(self) -> WalkGraph:
        return pi05_graph.build_graph(self.config.num_steps)

    def next_walk(self, state: WalkState) -> str | None:
        return pi05_graph.next_walk(state)

    def parse_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> Pi05Params:
        unknown = sorted(set(inputs) - _INPUTS)
        if unknown:
            raise ValueError(f"pi05: unknown inputs {unknown}; use {sorted(_INPUTS)}")
        for name in ("images", "image_masks", "token_ids"):
            if not inputs.get(name):
                raise ValueError(f"pi05: input {name!r} is required")
        r = Pi05Request.from_runtime(inputs, params)
        return Pi05Params(r.seed, validate_request(r, self.config))

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], request: Pi05Params) -> Mapping[str, int]:
        return {"prefix": request.prefix_tokens}

    def create_state(self, request_id, partition, inputs, params: Pi05Params) -> WalkState:
        r = Pi05Request.from_runtime(inputs, {})  # the inputs, checked by parse_request
        cfg = self.config
        noise = r.noise
        if noise is None:
            g = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(62))
            noise = torch.randn(cfg.horizon, cfg.action_dim, generator=g)
        mask = r.token_mask if r.token_mask is not None else torch.ones(r.token_ids.shape, dtype=torch.bool)
        tensors = {"images": [r.images], "image_masks": [r.image_masks], "token_ids": [r.token_ids.long()],
                   "token_mask": [mask], "actions": [noise.float()]}
        return WalkState(request_id=request_id, partition=partition, params=params, tensors=tensors)

    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        from mstar.models.pi05.loader import LLM, VISION, build_components
        from mstar.models.pi05.nodes import VisionNode

        names = list(node_names)
        unknown = sorted(set(names) - set(self.graph.node_names))
        if unknown:
            raise ValueError(f"{self.name} has no nodes {unknown}")
        need = {VISION if n == "vision" else LLM for n in names}
        parts = build_components(self.config, need, model_path=self.model_path, load_format=self.load_format,
                                 dtype=self.dtype, seed=self.seed, prepack=self.prepack)
        mods: dict[str, NodeSubmodule] = {}
        for n in names:
            mods[n] = VisionNode(parts[VISION]) if n == "vision" else parts[LLM]
        return mods

    def api_adapter(self):
        from mstar.models.pi05.adapter import Pi05Adapter

        return Pi05Adapter(self)


class Pi05Tiny(Pi05Model):
    """``PI05_TINY`` (the parity fixture's sizes) with seeded dummy weights: offline and fast."""

    name = "pi05-tiny"
    family = "pi05"

    def __init__(self, model_path: str | Path | None = None, load_format: str = "dummy",
                 dtype: str | torch.dtype = "float32", seed: int = 0, prepack: bool | None = None) -> None:
        reject_checkpoint(self.name, Pi05Model.name, model_path, load_format)
        super().__init__(None, "dummy", dtype, config=PI05_TINY, seed=seed, prepack=prepack)
