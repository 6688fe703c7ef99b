"""V-JEPA 2-AC's nodes: ``encoder`` (context frames -> tokens), ``predictor`` (frame blocks appended to
paged KV caches: rollout, context prefill, CEM samples in forked caches), ``cem_sampler`` and
``cem_update`` (the planning loop's sampling distribution)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.layers.attention_backends import AttentionBackend, default_backend
from mstar.layers.paged_attention import QueryMode
from mstar.model import KVSequence, KVSpec, NodeInputs, NodeSubmodule
from mstar.models.vjepa2.blocks import LeanBlock
from mstar.models.vjepa2.encoder import VJepaEncoder, encode_frames
from mstar.models.vjepa2.pose import compute_new_pose
from mstar.models.vjepa2.predictor import ACPredictor

__all__ = ["CemSampler", "CemUpdate", "EncoderNode", "PredictorNode"]


class EncoderNode(NodeSubmodule):
    """Context frames -> layer-normed tokens [T, N, D] (each frame encoded on its own, as the reference)."""

    def __init__(self, encoder: VJepaEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        goal = inputs["goal_frame"][0] if "goal_frame" in inputs else None
        return NodeInputs(args=_Frames(inputs["frames"][0], goal))

    def _encode(self, frames: torch.Tensor) -> torch.Tensor:
        tokens = encode_frames(self.encoder, frames.unsqueeze(0).to(torch.float32))[0]
        return tokens.view(frames.shape[0], -1, tokens.shape[-1])

    def forward(self, graph_walk, engine_inputs, **_):
        outs, goals = [], []
        with torch.inference_mode():
            for a in engine_inputs.args:
                frames, goal = a.frames, a.goal
                outs.append(self._encode(frames))  # requests may differ in frame count: one call each
                goals.append(self._encode(goal.unsqueeze(0))[0] if goal is not None else torch.empty(0))
        return {"context": outs, "feed": [t[-1] for t in outs], "goal": goals}


@dataclass(frozen=True, slots=True)
class _Frames:
    """The encoder's args: a request's context frames and its goal frame (a plan's; else None)."""

    frames: torch.Tensor
    goal: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Refit:
    """``CemUpdate``'s args: the refit distribution, the iteration's best energy, whether it was the last."""

    plan: torch.Tensor
    spread: torch.Tensor
    energy: torch.Tensor
    last: bool


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

    def __init__(self, predictor: ACPredictor, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.predictor = predictor
        self.backend = default_backend() if backend is None else backend
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
        horizon = fwd_info.params.horizon  # a VJepaRequest
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
            args=(step, given))  # the step, and the next state when the request gives it

    def forward(self, graph_walk, engine_inputs, tokens, action, state):
        ei, p, c = engine_inputs, self.predictor, self.predictor.cfg
        steps: list[_Step] = [s for s, _ in ei.args]
        frames = [f for s in steps for f in s.frames]  # every sequence of the batch, in order
        n_seq, n = len(frames), c.tokens_per_frame
        x = p._embed_frames(tokens.view(n_seq, 1, n, -1), action.view(n_seq, 1, -1), state.view(n_seq, 1, -1), None)
        x = x.flatten(0, 2)  # [sequences * block_tokens, D]
        tables = [self._rope(f, x.device) for f in frames]
        cos, sin = torch.cat([tc for tc, _ in tables]), torch.cat([ts for _, ts in tables])
        planned: list = []  # the compiled backend's block step, planned at the first layer for all

        def attend(q, k, v, kc, vc):
            if not planned:
                step = getattr(self.backend, "fused_block", None)
                planned.append(step(q, k, v, kc, vc, ei.attention) if step is not None else None)
            out = planned[0](q, k, v, kc, vc) if planned[0] is not None else None
            return self.backend.forward(q, k, v, kc, vc, ei.attention) if out is None else out

        blocks = list(p.predictor_blocks)
        if (x.dtype == torch.float32 and x.is_contiguous() and cos.dtype == sin.dtype == torch.float32
                and cos.is_contiguous() and sin.is_contiguous()):
            lean = [blk.lean() for blk in blocks]  # checked once per forward: the kernels directly
            if all(fn is not None for fn in lean):
                blocks = lean
        for layer, blk in enumerate(blocks):
            k_cache, v_cache = ei.kv_caches[layer]
            run = blk if isinstance(blk, LeanBlock) else blk.forward_rows
            x = run(x, cos, sin, lambda q, k, v, kc=k_cache, vc=v_cache: attend(q, k, v, kc, vc))
        pred = p._readout(x.view(n_seq, 1, c.block_tokens, -1)).view(n_seq, n, -1)
        pred = F.layer_norm(pred, (pred.shape[-1],))  # fed back normalised, as the reference wrapper
        next_state = compute_new_pose(state.view(n_seq, -1), action.view(n_seq, -1))
        out: dict[str, list] = {"feed": [], "frame": [], "state": [], "stop": []}
        start = 0
        for s, given in ei.args:
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
        req = fwd_info.params  # a VJepaRequest
        gen = torch.Generator().manual_seed(req.seed * 1_000_003 + fwd_info.iteration[0])
        cand = mean + std * torch.randn((req.samples, *mean.shape), generator=gen)
        return NodeInputs(args=cand)

    def forward(self, graph_walk, engine_inputs, **_):
        return {"candidates": list(engine_inputs.args)}


class CemUpdate(NodeSubmodule):
    """Scores each candidate by the L1 distance of its final predicted frame to the goal frame and refits
    the sampling distribution to the ``topk`` best; streams the best energy of every iteration."""

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        final, cand, goal = inputs["feed"][0], inputs["candidates"][0], inputs["goal"][0]
        energy = (final - goal.unsqueeze(0)).abs().mean(dim=(1, 2))  # [N]
        k = fwd_info.params.topk
        best = torch.topk(energy, k, largest=False).indices
        elite = cand[best]
        last = fwd_info.iteration[0] + 1 >= fwd_info.params.iterations
        return NodeInputs(args=_Refit(elite.mean(0), elite.std(0, unbiased=False), energy[best[0]].view(1), last))

    def forward(self, graph_walk, engine_inputs, **_):
        refits: list[_Refit] = engine_inputs.args
        return {"plan": [r.plan for r in refits], "spread": [r.spread for r in refits],
                "energy": [r.energy for r in refits], "stop": [torch.tensor(r.last) for r in refits]}
