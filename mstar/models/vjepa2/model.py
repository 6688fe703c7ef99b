"""``VJepa2AC``: V-JEPA 2-AC (ViT-g video encoder + action-conditioned predictor) served as the walks of
``graph.py`` with the nodes of ``nodes.py``; ``VJepa2ACTiny``, its offline twin.

Request inputs: ``frames`` [T, 3, H, W] (or ``context`` [T, N, D] already encoded), ``states``
[T, 7], ``actions`` [T + horizon - 1, 7]; params: ``horizon`` (frames to predict).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mstar.graph import WalkGraph
from mstar.layers.prepack import prepack_linears, prepack_requested
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.model.checkpoint import check_load_format, reject_checkpoint
from mstar.model.validation import check_int
from mstar.models.vjepa2 import graph as vjepa2_graph
from mstar.models.vjepa2.config import (
    AC_PREDICTOR,
    TINY_ENCODER,
    TINY_PREDICTOR,
    VITG_ENCODER,
    EncoderConfig,
    PredictorConfig,
)
from mstar.models.vjepa2.graph import MAX_FRAMES
from mstar.models.vjepa2.loader import build_vjepa2_ac, dummy_vjepa2
from mstar.models.vjepa2.nodes import CemSampler, CemUpdate, EncoderNode, PredictorNode
from mstar.models.vjepa2.request import VJepaRequest, VJepaTask

__all__ = ["LOAD_FORMATS", "VJepa2AC", "VJepa2ACTiny"]

LOAD_FORMATS = ("auto", "dummy")


class VJepa2AC(ModelDef):
    """V-JEPA 2-AC: ``model_path`` is the ``vjepa2-ac-vitg.pt`` checkpoint (encoder + predictor)."""

    checks_params = True  # parse_request looks up every params key (Runtime.submit refuses others)
    request_type = VJepaRequest

    name = "vjepa2-ac"

    def __init__(self, model_path: str | None = None, load_format: str = "auto",
                 encoder_config: EncoderConfig | None = None, predictor_config: PredictorConfig | None = None,
                 seed: int = 0) -> None:
        check_load_format(load_format, LOAD_FORMATS)
        if load_format != "dummy" and not model_path:
            raise ValueError("vjepa2-ac needs --model-path (vjepa2-ac-vitg.pt); or serve vjepa2-ac-tiny")
        self.model_path, self.load_format, self.seed = model_path, load_format, seed
        self.encoder_config = encoder_config or VITG_ENCODER
        self.predictor_config = predictor_config or AC_PREDICTOR

    def build_graph(self) -> WalkGraph:
        return vjepa2_graph.build_graph()

    def create_state(self, request_id, partition, inputs, params) -> WalkState:
        tensors = dict(inputs)
        tensors["state"] = [inputs["states"][0][-1]]  # the carried state's first value (unused before T)
        if "context" in inputs:
            tensors["feed"] = [inputs["context"][0][-1]]
        req: VJepaRequest = params
        if req.plans:  # the CEM's initial sampling distribution
            shape = (req.horizon, self.predictor_config.action_dim)
            tensors["plan"] = [torch.zeros(shape)]
            tensors["spread"] = [torch.full(shape, req.init_std)]
        return WalkState(request_id=request_id, partition=partition, params=params, tensors=tensors)

    def next_walk(self, state: WalkState) -> str | None:
        return vjepa2_graph.next_walk(state)

    def parse_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> VJepaRequest:
        ec, pc = self.encoder_config, self.predictor_config
        for name in ("states", "actions"):
            if name not in inputs:
                raise ValueError(f"vjepa2-ac: input {name!r} is required")
        if ("frames" in inputs) == ("context" in inputs):
            raise ValueError("vjepa2-ac: give exactly one of 'frames' [T, 3, H, W] or 'context' [T, N, D]")
        if "frames" in inputs:
            frames = inputs["frames"][0]
            want = (3, *ec.img_size)
            if frames.dim() != 4 or tuple(frames.shape[1:]) != want:
                raise ValueError(f"vjepa2-ac: frames must be [T, {want[0]}, {want[1]}, {want[2]}], got "
                                 f"{list(frames.shape)}")
            t = frames.shape[0]
        else:
            ctx = inputs["context"][0]
            if ctx.dim() != 3 or tuple(ctx.shape[1:]) != (pc.tokens_per_frame, pc.embed_dim):
                raise ValueError(f"vjepa2-ac: context must be [T, {pc.tokens_per_frame}, {pc.embed_dim}], got "
                                 f"{list(ctx.shape)}")
            t = ctx.shape[0]
        task = params.get("task", "rollout")
        if task not in ("rollout", "plan"):
            raise ValueError(f"vjepa2-ac: task must be 'rollout' or 'plan', got {task!r}")
        task = VJepaTask(task)
        horizon = check_int(params.get("horizon", 1), "vjepa2-ac: horizon")
        if t < 1 or t + horizon > MAX_FRAMES:
            raise ValueError(f"vjepa2-ac: context frames ({t}) + horizon ({horizon}) must be at most {MAX_FRAMES}")
        states, actions = inputs["states"][0], inputs["actions"][0]
        a = pc.action_dim
        if states.dim() != 2 or tuple(states.shape) != (t, a):
            raise ValueError(f"vjepa2-ac: states must be [{t}, {a}] (one per context frame), got {list(states.shape)}")
        need = t + horizon - 1 if task is VJepaTask.ROLLOUT else t - 1
        what = "context frames + horizon - 1" if task is VJepaTask.ROLLOUT else "the actions between context frames"
        if actions.dim() != 2 or actions.shape[1] != a or actions.shape[0] < need:
            raise ValueError(f"vjepa2-ac: actions must be [>= {need}, {a}] ({what}), got {list(actions.shape)}")
        cem = self._parse_plan(inputs, params) if task is VJepaTask.PLAN else {}
        if not all(torch.isfinite(x).all() for x in (states, actions)):
            raise ValueError("vjepa2-ac: states and actions must be finite")
        return VJepaRequest(task, horizon, **cem)

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], request: VJepaRequest) -> Mapping[str, int]:
        """The predictor's caches at their largest: a rollout's one cache holds every frame but the
        last predicted; a plan keeps the context (all frames but the last) plus one fork per sample
        growing by ``horizon`` frames, which share the context's blocks (a copy-on-write copy of a
        shared partial block is not counted: this bound never refuses a request that fits)."""
        t = (inputs["frames"] if "frames" in inputs else inputs["context"])[0].shape[0]
        horizon, bt = request.horizon, self.predictor_config.block_tokens
        if not request.plans:
            return {"predictor": (t + horizon - 1) * bt}
        return {"predictor": (t - 1) * bt + request.samples * horizon * bt}

    def _parse_plan(self, inputs, params) -> dict[str, Any]:
        """The CEM's numbers, checked (and that the goal is given)."""
        ec, pc = self.encoder_config, self.predictor_config
        if "frames" in inputs:
            goal = inputs.get("goal_frame", [None])[0]
            if goal is None or tuple(goal.shape) != (3, *ec.img_size):
                raise ValueError(f"vjepa2-ac: planning needs goal_frame [3, {ec.img_size[0]}, {ec.img_size[1]}]")
        else:
            goal = inputs.get("goal", [None])[0]
            if goal is None or tuple(goal.shape) != (pc.tokens_per_frame, pc.embed_dim):
                raise ValueError(f"vjepa2-ac: planning needs goal [{pc.tokens_per_frame}, {pc.embed_dim}]")
        samples, topk, iters = (params.get(k, d) for k, d in (("samples", 64), ("topk", 8), ("iterations", 4)))
        for name, v, hi in (("samples", samples, 1024), ("topk", topk, samples), ("iterations", iters, 64)):
            check_int(v, f"vjepa2-ac: {name}", 1, hi)
        seed = check_int(params.get("seed", 0), "vjepa2-ac: seed", 0, (1 << 62) // 1_000_003)  # the CEM draws' seed
        std = params.get("init_std", 0.1)  # the CEM's initial spread
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0.0 < float(std) < 1e6:
            raise ValueError(f"vjepa2-ac: init_std must be a positive number, got {std!r}")
        return {"samples": int(samples), "topk": int(topk), "iterations": int(iters), "seed": seed,
                "init_std": float(std)}

    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        names = list(node_names)
        if not names:
            return {}
        if self.load_format == "dummy":
            encoder, predictor = dummy_vjepa2(self.seed, self.encoder_config, self.predictor_config)
        else:
            encoder, predictor = build_vjepa2_ac(self.model_path, self.encoder_config, self.predictor_config)
        if prepack_requested():  # the projections through the panel kernel (mstar.layers.prepack)
            prepack_linears(encoder)
            prepack_linears(predictor)
        mods = {"encoder": EncoderNode(encoder.eval()), "predictor": PredictorNode(predictor.eval()),
                "cem_sampler": CemSampler(), "cem_update": CemUpdate()}
        unknown = [n for n in names if n not in mods]
        if unknown:
            raise ValueError(f"vjepa2-ac has no nodes {unknown}")
        return {n: mods[n] for n in names}


class VJepa2ACTiny(VJepa2AC):
    """Tiny encoder + predictor with dummy weights (32x32 frames, 2x2 patches): offline and fast."""

    name = "vjepa2-ac-tiny"

    def __init__(self, model_path: str | None = None, load_format: str = "dummy", seed: int = 0) -> None:
        reject_checkpoint(self.name, VJepa2AC.name, model_path, load_format)
        super().__init__(None, "dummy", TINY_ENCODER, TINY_PREDICTOR, seed)
