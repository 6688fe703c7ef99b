"""V-JEPA 2-AC as a Walk Graph: encode context frames, then roll the world model out frame by frame
over a persistent, frame-causal KV cache.

::

    encode:   frames -> encoder -> context (TO_STATE), feed (TO_STATE: the carried frame's first value)
    rollout:  DynamicLoop(predictor: context, actions, states, feed, state
                            -> feed, state (fed back), frame (client, one per predicted frame), stop)

Iteration i appends ONE frame block -- [action_i, state_i, 256 patch tokens] -- to the request's
predictor cache in "block append" mode (the block attends to every cached frame and to itself in
both directions; the reference's mask is frame-causal, so caching past frames is exact). Frames
0..T-1 are the context; from i = T-1 on, the block's output is the prediction of frame i+1
(layer-normed, as the reference's world-model wrapper does), which is streamed to the client and
fed back as frame i+1. States past the context are integrated on the node, in torch, from the
previous state and action (``compute_new_pose``). The native reference instead re-runs the
predictor over the whole trajectory at every step: (H+1)/2 times the token work at horizon H.

Request inputs: ``frames`` [T, 3, H, W] (or ``context`` [T, N, D] already encoded), ``states``
[T, 7], ``actions`` [T + horizon - 1, 7]; params: ``horizon`` (frames to predict).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mstar.graph import EMIT_TO_CLIENT, TO_STATE, DynamicLoop, GraphEdge, GraphNode, Walk, WalkGraph
from mstar.layers.paged_attention import QueryMode, paged_attention
from mstar.model import KVSpec, ModelDef, NodeInputs, NodeSubmodule, WalkState
from mstar.models.vjepa2.config import TINY_ENCODER, TINY_PREDICTOR, EncoderConfig, PredictorConfig
from mstar.models.vjepa2.loader import build_vjepa2_ac, dummy_vjepa2
from mstar.models.vjepa2.modules import ACPredictor, VJepaEncoder, encode_frames

MAX_FRAMES = 64  # context + predicted frames per request (bounds the rollout loop)


# -- pose integration (DROID-style state: xyz, euler xyz (extrinsic), gripper) ---------------------------
def euler_xyz_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """[..., 3] extrinsic x-y-z Euler angles -> [..., 3, 3] rotation matrices (R = Rz Ry Rx)."""
    a, b, c = angles.unbind(-1)
    ca, sa, cb, sb, cc, sc = a.cos(), a.sin(), b.cos(), b.sin(), c.cos(), c.sin()
    row0 = torch.stack([cc * cb, cc * sb * sa - sc * ca, cc * sb * ca + sc * sa], -1)
    row1 = torch.stack([sc * cb, sc * sb * sa + cc * ca, sc * sb * ca - cc * sa], -1)
    row2 = torch.stack([-sb, cb * sa, cb * ca], -1)
    return torch.stack([row0, row1, row2], -2)


def matrix_to_euler_xyz(m: torch.Tensor) -> torch.Tensor:
    """Inverse of ``euler_xyz_to_matrix`` (away from gimbal lock)."""
    b = -torch.asin(m[..., 2, 0].clamp(-1.0, 1.0))
    a = torch.atan2(m[..., 2, 1], m[..., 2, 2])
    c = torch.atan2(m[..., 1, 0], m[..., 0, 0])
    return torch.stack([a, b, c], -1)


def compute_new_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """[..., 7] pose + [..., 7] action delta -> new pose, as the reference's MPC utilities: xyz add,
    rotation composed as R(delta) @ R(pose), gripper added and clipped to [0, 1]."""
    xyz = pose[..., :3] + action[..., :3]
    rot = matrix_to_euler_xyz(euler_xyz_to_matrix(action[..., 3:6]) @ euler_xyz_to_matrix(pose[..., 3:6]))
    grip = (pose[..., 6:] + action[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, rot, grip], -1)


# -- nodes ----------------------------------------------------------------------------------------------
class EncoderNode(NodeSubmodule):
    """Context frames -> layer-normed tokens [T, N, D] (each frame encoded on its own, as the reference)."""

    def __init__(self, encoder: VJepaEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        return NodeInputs(extras={"frames": inputs["frames"][0]})

    def forward(self, graph_walk, engine_inputs, **_):
        outs = []
        with torch.inference_mode():
            for frames in engine_inputs.extras["frames"]:  # requests may differ in frame count
                tokens = encode_frames(self.encoder, frames.unsqueeze(0).to(torch.float32))[0]
                outs.append(tokens.view(frames.shape[0], -1, tokens.shape[-1]))
        return {"context": outs, "feed": [t[-1] for t in outs]}


@dataclass(frozen=True)
class _Step:
    frame: int  # index of the frame block appended now
    context_len: int
    emit: bool  # this block's output predicts a frame past the context
    last: bool


class PredictorNode(NodeSubmodule):
    """One frame block per request per step, appended to the request's paged KV cache."""

    def __init__(self, predictor: ACPredictor) -> None:
        super().__init__()
        self.predictor = predictor
        c = predictor.cfg
        self.kv_spec = KVSpec(c.depth, c.num_heads, c.head_dim)

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        c = self.predictor.cfg
        ctx, actions, states = inputs["context"][0], inputs["actions"][0], inputs["states"][0]
        t = ctx.shape[0]
        frame = fwd_info.cache_len // c.block_tokens
        horizon = int(fwd_info.params.get("horizon", 1))
        if frame < t:
            tokens, state = ctx[frame], states[frame]
        else:
            tokens, state = inputs["feed"][0], inputs["state"][0]
        step = _Step(frame, t, frame >= t - 1, frame >= t + horizon - 2)
        return NodeInputs(
            tensor_inputs={"tokens": tokens.to(torch.float32), "action": actions[frame].view(1, -1).float(),
                           "state": state.view(1, -1).float()},
            num_tokens=c.block_tokens, mode=QueryMode.BLOCK_APPEND,
            extras={"step": step, "given_next_state": states[frame + 1] if frame + 1 < t else None})

    def forward(self, graph_walk, engine_inputs, tokens, action, state):
        ei, p, c = engine_inputs, self.predictor, self.predictor.cfg
        steps: list[_Step] = ei.extras["step"]
        b, n = len(steps), c.tokens_per_frame
        x = p._embed_frames(tokens.view(b, 1, n, -1), action.view(b, 1, -1), state.view(b, 1, -1), None)
        x = x.flatten(0, 2)  # [B * block_tokens, D]
        tables = [p._frame_rope(s.frame, x.device) for s in steps]
        cos, sin = torch.cat([tc for tc, _ in tables]), torch.cat([ts for _, ts in tables])
        for layer, blk in enumerate(p.predictor_blocks):
            q, k, v = blk.attn._qkv(blk.norm1(x).unsqueeze(0), cos, sin)  # [1, H, L, hd]
            o = paged_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                *ei.kv_caches[layer], ei.attention)
            x = x + blk.attn._out(o.transpose(0, 1).unsqueeze(0))[0]
            x = x + blk.mlp(blk.norm2(x))
        pred = p._readout(x.view(b, 1, c.block_tokens, -1)).view(b, n, -1)
        pred = F.layer_norm(pred, (pred.shape[-1],))  # fed back normalised, as the reference wrapper
        next_state = compute_new_pose(state, action)
        given = ei.extras["given_next_state"]
        return {
            "feed": list(pred),
            "frame": [[pred[i]] if s.emit else [] for i, s in enumerate(steps)],
            "state": [g.float() if g is not None else next_state[i] for i, g in enumerate(given)],
            "stop": [torch.tensor(s.last) for s in steps],
        }


# -- the model ------------------------------------------------------------------------------------------
def build_vjepa2_graph(max_frames: int = MAX_FRAMES) -> WalkGraph:
    encode = GraphNode("encoder", ["frames"], [GraphEdge(TO_STATE, "context"), GraphEdge(TO_STATE, "feed")])
    rollout = DynamicLoop(
        GraphNode("predictor", ["context", "actions", "states", "feed", "state"],
                  [GraphEdge("predictor", "feed"), GraphEdge("predictor", "state"),
                   GraphEdge(EMIT_TO_CLIENT, "frame", output_modality="latent")]),
        max_iters=max_frames,
    )
    return WalkGraph([Walk("encode", encode, inputs=["frames"]),
                      Walk("rollout", rollout, inputs=["context", "actions", "states", "feed", "state"])])


class VJepa2AC(ModelDef):
    """V-JEPA 2-AC: ``model_path`` is the ``vjepa2-ac-vitg.pt`` checkpoint (encoder + predictor)."""

    name = "vjepa2-ac"

    def __init__(self, model_path: str | None = None, load_format: str = "auto",
                 encoder_config: EncoderConfig | None = None, predictor_config: PredictorConfig | None = None,
                 seed: int = 0) -> None:
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {load_format!r}; use auto or dummy")
        if load_format != "dummy" and not model_path:
            raise ValueError("vjepa2-ac needs --model-path (vjepa2-ac-vitg.pt); or serve vjepa2-ac-tiny")
        from mstar.models.vjepa2.config import AC_PREDICTOR, VITG_ENCODER

        self.model_path, self.load_format, self.seed = model_path, load_format, seed
        self.encoder_config = encoder_config or VITG_ENCODER
        self.predictor_config = predictor_config or AC_PREDICTOR

    def build_graph(self) -> WalkGraph:
        return build_vjepa2_graph()

    def create_state(self, request_id, partition, inputs, params) -> WalkState:
        tensors = dict(inputs)
        tensors["state"] = [inputs["states"][0][-1]]  # the carried state's first value (unused before T)
        if "context" in inputs:
            tensors["feed"] = [inputs["context"][0][-1]]
        return WalkState(request_id=request_id, partition=partition, params=params, tensors=tensors)

    def next_walk(self, state: WalkState) -> str | None:
        if state.last_walk is None:
            return "rollout" if "context" in state.tensors else "encode"
        return "rollout" if state.last_walk == "encode" else None

    def validate_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> None:
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
        horizon = params.get("horizon", 1)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"vjepa2-ac: horizon must be a positive int, got {horizon!r}")
        if t < 1 or t + horizon > MAX_FRAMES:
            raise ValueError(f"vjepa2-ac: context frames ({t}) + horizon ({horizon}) must be at most {MAX_FRAMES}")
        states, actions = inputs["states"][0], inputs["actions"][0]
        a = pc.action_dim
        if states.dim() != 2 or tuple(states.shape) != (t, a):
            raise ValueError(f"vjepa2-ac: states must be [{t}, {a}] (one per context frame), got {list(states.shape)}")
        need = t + horizon - 1
        if actions.dim() != 2 or actions.shape[1] != a or actions.shape[0] < need:
            raise ValueError(f"vjepa2-ac: actions must be [>= {need}, {a}] (context frames + horizon - 1), got "
                             f"{list(actions.shape)}")
        if not all(torch.isfinite(x).all() for x in (states, actions)):
            raise ValueError("vjepa2-ac: states and actions must be finite")

    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        names = list(node_names)
        if not names:
            return {}
        if self.load_format == "dummy":
            encoder, predictor = dummy_vjepa2(self.seed, self.encoder_config, self.predictor_config)
        else:
            encoder, predictor = build_vjepa2_ac(self.model_path, self.encoder_config, self.predictor_config)
        mods = {"encoder": EncoderNode(encoder.eval()), "predictor": PredictorNode(predictor.eval())}
        unknown = [n for n in names if n not in mods]
        if unknown:
            raise ValueError(f"vjepa2-ac has no nodes {unknown}")
        return {n: mods[n] for n in names}


class VJepa2ACTiny(VJepa2AC):
    """Tiny encoder + predictor with dummy weights (32x32 frames, 2x2 patches): offline and fast."""

    name = "vjepa2-ac-tiny"

    def __init__(self, model_path: str | None = None, load_format: str = "dummy", seed: int = 0) -> None:
        if model_path is not None or load_format != "dummy":
            raise ValueError("vjepa2-ac-tiny always uses dummy weights; use vjepa2-ac with --model-path")
        super().__init__(None, "dummy", TINY_ENCODER, TINY_PREDICTOR, seed)


def native_rollout(predictor: ACPredictor, context: torch.Tensor, states: torch.Tensor, actions: torch.Tensor,
                   horizon: int) -> list[torch.Tensor]:
    """The reference's rollout, for tests and benchmarks: at every step, the predictor over the WHOLE
    trajectory so far (no cache); keep the last frame's prediction, layer-normed; integrate the pose."""
    c = predictor.cfg
    n = c.tokens_per_frame
    z = [f for f in context]
    s = [st for st in states]
    preds = []
    with torch.inference_mode():
        for _ in range(horizon):
            t = len(z)
            out = predictor.forward_full(torch.cat(z)[None], actions[None, :t], torch.stack(s)[None])
            nxt = F.layer_norm(out[0, -n:], (out.shape[-1],))
            preds.append(nxt)
            s.append(compute_new_pose(s[-1], actions[t - 1]))
            z.append(nxt)
    return preds


__all__ = ["MAX_FRAMES", "PredictorNode", "EncoderNode", "VJepa2AC", "VJepa2ACTiny", "build_vjepa2_graph",
           "compute_new_pose", "native_rollout"]
