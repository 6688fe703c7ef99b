"""BAGEL served: the Walk Graph of ``graph.py`` with real computations (``nodes.py``); ``BagelTiny``,
its offline twin.

A request is a list of items (text and images, in order) and a target:

* ``target="text"`` (image understanding, or plain chat): ``prefill_text`` / ``prefill_vit`` per item,
  then ``decode`` (greedy by default; stops at ``<|im_end|>``);
* ``target="image"`` (text-to-image, editing): ``prefill_text`` / ``prefill_vae`` + ``prefill_vit``
  per item, then ``image_gen_cfg`` (or ``image_gen`` when no guidance is on), which ends in the VAE
  decoder and emits the image.

Runtime-level inputs (also the native ``/generate`` route): ``text_ids`` (one 1-D int tensor per text
item, WITHOUT BAGEL's ``<|im_start|>``/``<|im_end|>`` wrapping, which the model adds) and ``images``
(one ``uint8 [H, W, 3]`` tensor per image). Parameters: ``target``; ``order`` (item kinds in order,
e.g. ``["image", "text"]``; default: images first, as the reference inferencer); ``height``/``width``
(text-to-image size); ``seed`` (initial noise); the flow settings of ``mstar.models.bagel.flow``
(``cfg_text_scale``, ``cfg_img_scale``, ``cfg_interval``, ``cfg_renorm_type``, ``cfg_renorm_min``,
``num_timesteps``, ``timestep_shift``; defaults: the reference's text-to-image settings, or its
editing settings when an image is in the context); ``max_tokens`` and ``sampling`` for text.
``parse_request`` makes them a ``BagelRequest`` once, its layout planned then.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.graph import WalkGraph
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.model.checkpoint import check_load_format, reject_checkpoint, resolve_dtype
from mstar.model.decode import exact_length_params
from mstar.model.tokenizer import LazyTokenizer
from mstar.model.validation import check_int
from mstar.models.bagel import graph as bagel_graph
from mstar.models.bagel.config import TINY_SPEC, BagelSpec, ImageTransformSpec
from mstar.models.bagel.flow import FlowSettings, flow_settings, timestep_schedule
from mstar.models.bagel.image_transform import BagelImageTransform, InputImageTransforms
from mstar.models.bagel.layout import plan_layout
from mstar.models.bagel.nodes import (
    CombineCFG,
    SpecialTokens,
    VAEDecoderNode,
    VAEEncoderNode,
    ViTNode,
    request_sampling,
)
from mstar.models.bagel.request import BagelLayout, BagelRequest

__all__ = ["BagelByteTokenizer", "BagelModel", "BagelState", "BagelTiny"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MAX_IMAGES = 8


class BagelByteTokenizer:
    """UTF-8 bytes (ids 3..258, as ``ByteTokenizer``) plus BAGEL's specials at 259..262."""

    offset, vocab_size = 3, 264
    specials = {"<|im_start|>": 259, "<|im_end|>": 260, "<|vision_start|>": 261, "<|vision_end|>": 262}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < 259).decode("utf-8", "replace")

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token)


@dataclass
class BagelState(WalkState):
    steps: list[tuple[str, dict[str, list[Any]]]] = field(default_factory=list)
    final: tuple[str, dict[str, list[Any]]] | None = None


class BagelModel(LazyTokenizer, ModelDef):
    """``ByteDance-Seed/BAGEL-7B-MoT`` (``model_path``: ema.safetensors, ae.safetensors, llm_config.json,
    vit_config.json, tokenizer.json) or, with ``load_format="dummy"``, seeded random weights."""

    checks_params = True  # parse_request looks up every params key (Runtime.submit refuses others)
    request_type = BagelRequest

    name = "bagel"
    family = "bagel"
    views = {"LLM_cfg_text": "LLM", "LLM_cfg_img": "LLM"}

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto",
                 dtype: str | torch.dtype = "float32", spec: BagelSpec | None = None, seed: int = 0) -> None:
        check_load_format(load_format)
        self.model_path = str(model_path) if model_path is not None else None
        self.load_format, self.dtype, self.seed = load_format, resolve_dtype(dtype), seed
        self._spec = spec  # read from the checkpoint on first use (drawing the graph needs no files)
        self._resize: tuple[BagelImageTransform, BagelImageTransform] | None = None

    @property
    def spec(self) -> BagelSpec:
        if self._spec is None:
            from mstar.models.bagel.loader import load_spec

            if self.model_path is None:
                raise ValueError(f"{self.name}: --model-path (a BAGEL checkpoint directory) is required; "
                                 f"use bagel-tiny for a model without files")
            self._spec = load_spec(self.model_path)
        return self._spec

    def preflight(self) -> None:
        self.spec  # noqa: B018 - reads and checks the checkpoint's configs (clear error without --model-path)
        self.special_tokens  # noqa: B018 - the tokenizer has BAGEL's four special tokens

    @property
    def vae_resize(self) -> BagelImageTransform:
        return self._transforms()[0]

    @property
    def vit_resize(self) -> BagelImageTransform:
        return self._transforms()[1]

    @property
    def input_transforms(self) -> InputImageTransforms:
        return InputImageTransforms(*self._transforms())

    def _transforms(self) -> tuple[BagelImageTransform, BagelImageTransform]:
        if self._resize is None:
            self._resize = (BagelImageTransform(*_astuple(self.spec.vae_transform)),
                            BagelImageTransform(*_astuple(self.spec.vit_transform)))
        return self._resize

    # -- tokenizer -------------------------------------------------------------------------------
    def _load_tokenizer(self) -> Any:
        from mstar.models.bagel.loader import load_tokenizer

        return load_tokenizer(self.model_path)

    @property
    def special_tokens(self) -> SpecialTokens:
        tok = self.tokenizer
        ids = [tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")]
        if any(i is None for i in ids):
            raise ValueError(f"{self.name}: the tokenizer lacks BAGEL's special tokens "
                             f"<|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>")
        return SpecialTokens(*ids)

    # -- graph and state machine -----------------------------------------------------------------
    def sized_request(self, prompt_tokens: int, output_tokens: int, params: Mapping[str, Any],
                      seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Random prompt ids; ``target: image`` (the class's params: size, steps, guidance) makes an
        image and ignores ``output_tokens``, else exactly ``output_tokens`` text tokens (EOS ignored)."""
        ids = torch.randint(1, max(2, self.spec.llm.vocab_size - 8), (prompt_tokens,),
                            generator=torch.Generator().manual_seed(seed))
        if params.get("target") == "image":
            return {"text_ids": [ids]}, {"seed": seed, **params}
        return {"text_ids": [ids]}, exact_length_params(params, output_tokens)

    def build_graph(self) -> WalkGraph:
        return bagel_graph.build_graph()

    def _order(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> list[str]:
        texts, images = len(inputs.get("text_ids", [])), len(inputs.get("images", []))
        order = params.get("order")
        if order is None:
            return ["image"] * images + ["text"] * texts
        if (not isinstance(order, (list, tuple)) or any(k not in ("text", "image") for k in order)
                or list(order).count("text") != texts or list(order).count("image") != images):
            raise ValueError(f"order must list 'text' {texts} times and 'image' {images} times, got {order!r}")
        return list(order)

    def _image_size(self, params: Mapping[str, Any]) -> tuple[int, int]:
        h = params.get("height", self.spec.default_size[0])
        w = params.get("width", self.spec.default_size[1])
        ld, top = self.spec.latent_downsample, self.spec.max_image_side
        for name, v in (("height", h), ("width", w)):
            if isinstance(v, bool) or not isinstance(v, int) or not ld <= v <= top or v % ld:
                raise ValueError(f"{name} must be a multiple of {ld} in [{ld}, {top}], got {v!r}")
        return h, w

    def parse_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> BagelRequest:
        """The request checked, its settings parsed and its layout planned, once."""
        unknown = sorted(set(inputs) - {"text_ids", "images"})
        if unknown:
            raise ValueError(f"{self.name}: unknown inputs {unknown}; use text_ids and images")
        target = params.get("target", "text")
        if target not in ("text", "image"):
            raise ValueError(f"target must be 'text' or 'image', got {target!r}")
        vocab = self.spec.llm.vocab_size
        texts = inputs.get("text_ids", [])
        for ids in texts:
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in _INT_DTYPES:
                raise ValueError("text_ids must be 1-D integer tensors of token ids")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise ValueError(f"text_ids must be token ids in [0, {vocab})")
        images = inputs.get("images", [])
        if len(images) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} images per request, got {len(images)}")
        for img in images:
            if (not isinstance(img, torch.Tensor) or img.dim() != 3 or img.shape[-1] != 3
                    or img.dtype != torch.uint8 or min(img.shape[0], img.shape[1]) < 1):
                raise ValueError("images must be uint8 tensors [H, W, 3]")
        if not texts and not images:
            raise ValueError(f"{self.name}: the request has neither text nor images")
        order = self._order(inputs, params)
        if target == "text":
            sp = request_sampling(params)
            request = BagelRequest("text", self._plan(inputs, order, None), sampling=sp)
        else:
            if images and ("height" in params or "width" in params):
                raise ValueError("height/width apply to text-to-image; an edit keeps its input image's size")
            size = None if images else self._image_size(params)
            fs = flow_settings(params, editing=bool(images))
            output_type = params.get("output_type", "pil")
            if output_type not in ("pil", "latent"):
                raise ValueError(f"output_type must be 'pil' or 'latent', got {output_type!r}")
            seed = params.get("seed")
            if seed is not None:
                check_int(seed, "seed", lo=0)
            request = BagelRequest("image", self._plan(inputs, order, fs, size), flow=fs, seed=seed,
                                   latent_out=output_type == "latent")
        self._check_context(request)
        return request

    def _image_tokens(self, height: int, width: int) -> tuple[int, int, tuple[int, int]]:
        """(VAE tokens, ViT tokens, VAE-sized (h, w)) of an input image, each count including the
        start/end-of-image tokens; from the resize rule alone (the ViT sees the VAE-resized image)."""
        ld, patch = self.spec.latent_downsample, self.spec.vit.patch_size
        vw, vh = self.vae_resize.target_size(width, height)
        tw, th = self.vit_resize.target_size(vw, vh)
        return (vh // ld) * (vw // ld) + 2, (th // patch) * (tw // patch) + 2, (vh, vw)

    def _plan(self, inputs: Mapping[str, list[Any]], order: list[str], fs: FlowSettings | None,
              size: tuple[int, int] | None = None) -> BagelLayout:
        """The request's layout (``fs``: an image target's flow settings; ``size``: its text-to-image
        size). The one place the context is laid out."""
        texts, images = iter(inputs.get("text_ids", [])), iter(inputs.get("images", []))
        items, vae_hw = [], None  # per item: (kind, tokens) for the layout
        for kind in order:
            if kind == "text":
                items.append(("text", next(texts).numel() + 2, 0))
                continue
            img = next(images)
            vae_tokens, vit_tokens, vae_hw = self._image_tokens(int(img.shape[0]), int(img.shape[1]))
            items.append(("image", vae_tokens, vit_tokens))
        lat_hw, cfg_img = None, False
        if fs is not None:
            ld = self.spec.latent_downsample
            h, w = vae_hw if vae_hw is not None else size
            lat_hw = (h // ld, w // ld)
            cfg_img = vae_hw is not None and fs.cfg_text_scale > 1.0 and fs.cfg_img_scale > 1.0
        steps, ctx = plan_layout(items, "image" if fs is not None else "text", cfg_img, lat_hw)
        return BagelLayout(tuple(order), tuple(steps), ctx, lat_hw)

    def prompt_tokens(self, request: BagelRequest) -> int:
        """The tokens the request's prompt puts in the main context: its texts with their wrapping
        tokens and each input image's ViT tokens (and, when generating an image, its VAE tokens)."""
        return request.layout.ctx.length

    def _check_context(self, request: BagelRequest) -> None:
        ctx = request.layout.ctx
        gen = request.gen_tokens or 1
        limit = self.spec.llm.max_position_embeddings
        if ctx.rope + gen > limit:
            raise ValueError(f"{self.name}: the context ({ctx.rope} positions) + {gen} to generate = "
                             f"{ctx.rope + gen} exceeds the model's context ({limit} positions)")

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], request: BagelRequest) -> Mapping[str, int]:
        """The main cache and the text-only cache of image guidance, plus the decoded tokens (flow steps
        attend read-only and the guidance forks share their prefix, so neither adds any)."""
        ctx = request.layout.ctx
        return {"LLM": ctx.length + ctx.img_len + request.gen_tokens}

    def create_state(self, request_id, partition, inputs, request: BagelRequest):
        layout = request.layout
        walk_inputs = []  # per item: the walks' input tensors
        texts, images = iter(inputs.get("text_ids", [])), iter(inputs.get("images", []))
        for kind in layout.order:
            if kind == "text":
                walk_inputs.append({"prefill_text": {"text_ids": [next(texts).long()]}})
                continue
            raw = next(images)  # resized and normalised by the encoder nodes (InputImageTransforms)
            walk_inputs.append({"prefill_vae": {"image": [raw]}, "prefill_vit": {"image": [raw]}})
        walk_steps = [(s.walk, {**walk_inputs[s.item][s.walk], "ctx": [s.ctx.to_tensor()]}) for s in layout.steps]
        ctx = layout.ctx
        if request.target == "image":
            fs, (lat_h, lat_w) = request.flow, layout.lat_hw
            seed = request.seed
            g = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(62))
            noise = torch.randn(lat_h * lat_w, self.spec.latent_dim, generator=g)
            times = timestep_schedule(fs.num_timesteps, fs.timestep_shift)[0]
            guided = any(fs.branch_active("cfg_text", t) for t in times)
            final = ("image_gen_cfg" if guided else "image_gen",
                     {"latents": [noise], "time_index": [torch.tensor(0)], "ctx": [ctx.to_tensor()]})
        else:
            final = ("decode", {"token": [torch.tensor([self.special_tokens.im_start])], "ctx": [ctx.to_tensor()]})
        return BagelState(request_id=request_id, partition=partition, params=request, tensors={},
                          steps=walk_steps, final=final)

    def next_walk(self, state: BagelState) -> str | None:
        return bagel_graph.next_walk(state)

    # -- modules ---------------------------------------------------------------------------------
    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        from mstar.models.bagel.loader import build_components

        names = list(node_names)
        unknown = sorted(set(names) - set(self.graph.node_names))
        if unknown:
            raise ValueError(f"{self.name} has no nodes {unknown}")
        need = {self.module_of(n) for n in names}
        parts = build_components(self.spec, need, self.special_tokens, model_path=self.model_path,
                                 load_format=self.load_format, dtype=self.dtype, seed=self.seed)
        mods: dict[str, NodeSubmodule] = {}
        for n in names:
            base = self.module_of(n)
            if base == "LLM":
                mods[n] = parts["LLM"]
            elif base == "combine_cfg":
                mods[n] = parts.setdefault("combine_cfg", CombineCFG())
            elif base == "vit_encoder":
                mods[n] = parts.setdefault("vit_encoder", ViTNode(parts["vit"], self.input_transforms))
            elif base == "vae_encoder":
                mods[n] = parts.setdefault("vae_encoder", VAEEncoderNode(parts["vae"], self.spec.latent_patch_size,
                                                                         self.input_transforms))
            elif base == "vae_decoder":
                mods[n] = parts.setdefault("vae_decoder", VAEDecoderNode(parts["vae"], self.spec.latent_patch_size,
                                                                         self.spec.vae.latent_channels))
        return mods

    def api_adapter(self):
        from mstar.models.bagel.adapter import BagelAdapter

        return BagelAdapter(self)


def _astuple(spec: ImageTransformSpec) -> tuple[int, int, int, int]:
    return spec.max_size, spec.min_size, spec.stride, spec.max_pixels


class BagelTiny(BagelModel):
    """``TINY_SPEC`` with seeded dummy weights and the byte tokenizer: runs offline, no files."""

    name = "bagel-tiny"
    family = "bagel"

    def __init__(self, model_path: str | Path | None = None, load_format: str = "dummy",
                 dtype: str | torch.dtype = "float32", seed: int = 0) -> None:
        reject_checkpoint(self.name, BagelModel.name, model_path, load_format)
        super().__init__(None, "dummy", dtype, spec=TINY_SPEC, seed=seed)

    def _load_tokenizer(self) -> Any:
        return BagelByteTokenizer()
