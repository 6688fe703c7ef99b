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

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Sequential,
    Walk,
    WalkGraph,
)
from mstar.layers.paged_attention import QueryMode, paged_attention
from mstar.model import KVSequence, KVSpec, ModelDef, NodeInputs, NodeSubmodule, WalkState
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
        goal = inputs["goal_frame"][0] if "goal_frame" in inputs else None
        return NodeInputs(extras={"frames": inputs["frames"][0], "goal": goal})

    def _encode(self, frames: torch.Tensor) -> torch.Tensor:
        tokens = encode_frames(self.encoder, frames.unsqueeze(0).to(torch.float32))[0]
        return tokens.view(frames.shape[0], -1, tokens.shape[-1])

    def forward(self, graph_walk, engine_inputs, **_):
        outs, goals = [], []
        with torch.inference_mode():
            for frames, goal in zip(engine_inputs.extras["frames"], engine_inputs.extras["goal"]):
                outs.append(self._encode(frames))  # requests may differ in frame count: one call each
                goals.append(self._encode(goal.unsqueeze(0))[0] if goal is not None else torch.empty(0))
        return {"context": outs, "feed": [t[-1] for t in outs], "goal": goals}


@dataclass(frozen=True)
class _Step:
    walk: str
    frames: tuple[int, ...]  # frame index of each sequence's appended block
    context_len: int
    emit: bool  # rollout: this block's output predicts a frame past the context
    last: bool  # the loop ends after this step


class PredictorNode(NodeSubmodule):
    """Frame blocks appended to paged KV caches, one block per sequence per step.

    Walks: ``rollout`` (one sequence, the request's cache: context frames, then its own predictions),
    ``prefill_context`` (context frames 0..T-2 only, for planning) and ``plan`` (one sequence per CEM
    sample, each in a cache forked from the context cache and re-forked at every CEM iteration).
    """

    def __init__(self, predictor: ACPredictor) -> None:
        super().__init__()
        self.predictor = predictor
        c = predictor.cfg
        self.kv_spec = KVSpec(c.depth, c.num_heads, c.head_dim)
        self._rope_cache: dict = {}

    def _rope(self, frame: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables of a frame position, computed once per position."""
        key = (frame, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = self.predictor._frame_rope(frame, device)
        return self._rope_cache[key]

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        c = self.predictor.cfg
        bt = c.block_tokens
        ctx, states = inputs["context"][0], inputs["states"][0]
        t = ctx.shape[0]
        horizon = int(fwd_info.params.get("horizon", 1))
        given = None
        if graph_walk == "plan":
            cand = inputs["candidates"][0]  # [N, H, A]
            n, j = cand.shape[0], fwd_info.iteration[-1]
            if j == 0:
                tokens = ctx[t - 1].unsqueeze(0).expand(n, -1, -1)
                state = states[t - 1].unsqueeze(0).expand(n, -1)
            else:
                tokens, state = inputs["feed"][0], inputs["state"][0]
            # every sample continues the context (frames 0..T-2, when there are any) in its own fork
            base = ("predictor", None) if t >= 2 else None
            seqs = [KVSequence(f"sample{k}", bt, QueryMode.BLOCK_APPEND, base, refork=j == 0) for k in range(n)]
            step = _Step("plan", (t - 1 + j,) * n, t, False, j >= horizon - 1)
            action = cand[:, j]
        else:
            frame = fwd_info.cache_len // bt
            seqs = None
            action = inputs["actions"][0][frame].view(1, -1)
            if frame < t:
                tokens, state = ctx[frame].unsqueeze(0), states[frame].view(1, -1)
            else:
                tokens, state = inputs["feed"][0].unsqueeze(0), inputs["state"][0].view(1, -1)
            if graph_walk == "prefill_context":
                step = _Step(graph_walk, (frame,), t, False, frame >= t - 2)
            else:
                step = _Step(graph_walk, (frame,), t, frame >= t - 1, frame >= t + horizon - 2)
            given = states[frame + 1] if frame + 1 < t else None
        return NodeInputs(
            tensor_inputs={"tokens": tokens.reshape(-1, tokens.shape[-1]).float(), "action": action.float(),
                           "state": state.float()},
            num_tokens=len(step.frames) * bt, mode=QueryMode.BLOCK_APPEND, sequences=seqs,
            extras={"step": step, "given_next_state": given})

    def forward(self, graph_walk, engine_inputs, tokens, action, state):
        ei, p, c = engine_inputs, self.predictor, self.predictor.cfg
        steps: list[_Step] = ei.extras["step"]
        frames = [f for s in steps for f in s.frames]  # every sequence of the batch, in order
        n_seq, n = len(frames), c.tokens_per_frame
        x = p._embed_frames(tokens.view(n_seq, 1, n, -1), action.view(n_seq, 1, -1), state.view(n_seq, 1, -1), None)
        x = x.flatten(0, 2)  # [sequences * block_tokens, D]
        tables = [self._rope(f, x.device) for f in frames]
        cos, sin = torch.cat([tc for tc, _ in tables]), torch.cat([ts for _, ts in tables])
        for layer, blk in enumerate(p.predictor_blocks):
            q, k, v = blk.attn._qkv(blk.norm1(x).unsqueeze(0), cos, sin)  # [1, H, L, hd]
            o = paged_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                *ei.kv_caches[layer], ei.attention)
            x = x + blk.attn._out(o.transpose(0, 1).unsqueeze(0))[0]
            x = x + blk.mlp(blk.norm2(x))
        pred = p._readout(x.view(n_seq, 1, c.block_tokens, -1)).view(n_seq, n, -1)
        pred = F.layer_norm(pred, (pred.shape[-1],))  # fed back normalised, as the reference wrapper
        next_state = compute_new_pose(state.view(n_seq, -1), action.view(n_seq, -1))
        out: dict[str, list] = {"feed": [], "frame": [], "state": [], "stop": []}
        start = 0
        for s, given in zip(steps, ei.extras["given_next_state"]):
            end = start + len(s.frames)
            if s.walk == "plan":
                out["feed"].append(pred[start:end])
                out["state"].append(next_state[start:end])
            else:
                out["feed"].append(pred[start])
                out["state"].append(given.float() if given is not None else next_state[start])
            out["frame"].append([pred[start]] if s.emit else [])
            out["stop"].append(torch.tensor(s.last))
            start = end
        return out


class CemSampler(NodeSubmodule):
    """Draws the CEM candidates: ``samples`` action sequences ~ N(plan, spread), seeded per request and
    CEM iteration (so a request's plan does not depend on what it is batched with)."""

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        mean, std = inputs["plan"][0], inputs["spread"][0]
        p = fwd_info.params
        gen = torch.Generator().manual_seed(int(p.get("seed", 0)) * 1_000_003 + fwd_info.iteration[0])
        cand = mean + std * torch.randn((int(p.get("samples", 64)), *mean.shape), generator=gen)
        return NodeInputs(extras={"candidates": cand})

    def forward(self, graph_walk, engine_inputs, **_):
        return {"candidates": list(engine_inputs.extras["candidates"])}


class CemUpdate(NodeSubmodule):
    """Scores each candidate by the L1 distance of its final predicted frame to the goal frame and refits
    the sampling distribution to the ``topk`` best; streams the best energy of every iteration."""

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        final, cand, goal = inputs["feed"][0], inputs["candidates"][0], inputs["goal"][0]
        energy = (final - goal.unsqueeze(0)).abs().mean(dim=(1, 2))  # [N]
        k = int(fwd_info.params.get("topk", 8))
        best = torch.topk(energy, k, largest=False).indices
        elite = cand[best]
        last = fwd_info.iteration[0] + 1 >= int(fwd_info.params.get("iterations", 4))
        return NodeInputs(extras={"plan": elite.mean(0), "spread": elite.std(0, unbiased=False),
                                  "energy": energy[best[0]].view(1), "last": last})

    def forward(self, graph_walk, engine_inputs, **_):
        e = engine_inputs.extras
        return {"plan": e["plan"], "spread": e["spread"], "energy": e["energy"],
                "stop": [torch.tensor(x) for x in e["last"]]}


# -- the model ------------------------------------------------------------------------------------------
def build_vjepa2_graph(max_frames: int = MAX_FRAMES, max_cem_iters: int = 64) -> WalkGraph:
    encode = GraphNode("encoder", ["frames"], [GraphEdge(TO_STATE, "context"), GraphEdge(TO_STATE, "feed")])
    encode_plan = GraphNode("encoder", ["frames", "goal_frame"],
                            [GraphEdge(TO_STATE, "context"), GraphEdge(TO_STATE, "feed"), GraphEdge(TO_STATE, "goal")])
    rollout = DynamicLoop(
        GraphNode("predictor", ["context", "actions", "states", "feed", "state"],
                  [GraphEdge("predictor", "feed"), GraphEdge("predictor", "state"),
                   GraphEdge(EMIT_TO_CLIENT, "frame", output_modality="latent")]),
        max_iters=max_frames,
    )
    prefill_context = DynamicLoop(GraphNode("predictor", ["context", "actions", "states"]), max_iters=max_frames)
    plan = DynamicLoop(
        Sequential([
            GraphNode("cem_sampler", ["plan", "spread"],
                      [GraphEdge("predictor", "candidates"), GraphEdge("cem_update", "candidates")]),
            DynamicLoop(
                GraphNode("predictor", ["context", "states", "candidates", "feed", "state"],
                          [GraphEdge("predictor", "feed"), GraphEdge("predictor", "state")]),
                max_iters=max_frames, outputs=[GraphEdge("cem_update", "feed")], name="horizon"),
            GraphNode("cem_update", ["feed", "candidates", "goal"],
                      [GraphEdge("cem_sampler", "plan"), GraphEdge("cem_sampler", "spread"),
                       GraphEdge(EMIT_TO_CLIENT, "energy")]),
        ]),
        max_iters=max_cem_iters, stop_node="cem_update", name="cem",
        outputs=[GraphEdge(EMIT_TO_CLIENT, "plan", output_modality="actions")],
    )
    return WalkGraph([
        Walk("encode", encode, inputs=["frames"]),
        Walk("encode_plan", encode_plan, inputs=["frames", "goal_frame"]),
        Walk("rollout", rollout, inputs=["context", "actions", "states", "feed", "state"]),
        Walk("prefill_context", prefill_context, inputs=["context", "actions", "states"]),
        Walk("plan", plan, inputs=["plan", "spread", "context", "states", "feed", "state", "goal"]),
    ])


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
        if params.get("task") == "plan":  # the CEM's initial sampling distribution
            shape = (int(params.get("horizon", 1)), self.predictor_config.action_dim)
            tensors["plan"] = [torch.zeros(shape)]
            tensors["spread"] = [torch.full(shape, float(params.get("init_std", 0.1)))]
        return WalkState(request_id=request_id, partition=partition, params=params, tensors=tensors)

    def next_walk(self, state: WalkState) -> str | None:
        plan = state.params.get("task") == "plan"
        t = self._context_frames(state.tensors)
        order = (["encode_plan"] if "frames" in state.tensors else []) + (
            (["prefill_context"] if t >= 2 else []) + ["plan"] if plan else ["rollout"])
        if "frames" in state.tensors and not plan:
            order = ["encode", "rollout"]
        done = len(state.history)
        return order[done] if done < len(order) else None

    @staticmethod
    def _context_frames(tensors) -> int:
        return (tensors["frames"] if "frames" in tensors else tensors["context"])[0].shape[0]

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
        task = params.get("task", "rollout")
        if task not in ("rollout", "plan"):
            raise ValueError(f"vjepa2-ac: task must be 'rollout' or 'plan', got {task!r}")
        horizon = params.get("horizon", 1)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"vjepa2-ac: horizon must be a positive int, got {horizon!r}")
        if t < 1 or t + horizon > MAX_FRAMES:
            raise ValueError(f"vjepa2-ac: context frames ({t}) + horizon ({horizon}) must be at most {MAX_FRAMES}")
        states, actions = inputs["states"][0], inputs["actions"][0]
        a = pc.action_dim
        if states.dim() != 2 or tuple(states.shape) != (t, a):
            raise ValueError(f"vjepa2-ac: states must be [{t}, {a}] (one per context frame), got {list(states.shape)}")
        need = t + horizon - 1 if task == "rollout" else t - 1
        what = "context frames + horizon - 1" if task == "rollout" else "the actions between context frames"
        if actions.dim() != 2 or actions.shape[1] != a or actions.shape[0] < need:
            raise ValueError(f"vjepa2-ac: actions must be [>= {need}, {a}] ({what}), got {list(actions.shape)}")
        if task == "plan":
            self._validate_plan(inputs, params)
        if not all(torch.isfinite(x).all() for x in (states, actions)):
            raise ValueError("vjepa2-ac: states and actions must be finite")

    def _validate_plan(self, inputs, params) -> None:
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
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ValueError(f"vjepa2-ac: {name} must be an int in [1, {hi}], got {v!r}")

    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        names = list(node_names)
        if not names:
            return {}
        if self.load_format == "dummy":
            encoder, predictor = dummy_vjepa2(self.seed, self.encoder_config, self.predictor_config)
        else:
            encoder, predictor = build_vjepa2_ac(self.model_path, self.encoder_config, self.predictor_config)
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
