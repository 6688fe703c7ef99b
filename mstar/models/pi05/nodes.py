"""pi0.5's node computations: ``vision`` (SigLIP over every valid camera of every request in the
batch, in one call) and ``prefix`` / ``expert`` (one module: the PaliGemma prefix and the action
expert, attending jointly over the paged KV cache).

A forward of the ``prefix`` module may mix the two kinds of item, layer by layer as the reference's
Mixture-of-Transformers does: each token takes the projections, norms and MLP of its own stack
(prefix tokens PaliGemma's, action tokens the expert's) and all go through ONE paged attention call
per layer:

* a prefix item brings its valid image tokens and valid text tokens (masked cameras and padding are
  dropped, so the positions ``cumsum(valid) - 1`` are just ``0..n-1``) in ``BLOCK_APPEND`` mode on
  a fresh cache: bidirectional among themselves, K/V stored;
* a flow-step item brings its ``horizon`` action tokens in ``READ_ONLY`` mode on the same cache:
  they see every cached prefix token and each other, and nothing is written. Their positions are
  ``n_prefix + 0..horizon-1``, which the engine's read-only positions already are.

The step's Euler update happens here too, so the loop body is this one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.layers.paged_attention import QueryMode, paged_attention
from mstar.model import EngineInputs, KVSequence, KVSpec, NodeInputs, NodeSubmodule
from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.expert import ActionExpert, TimeModulation
from mstar.models.pi05.flow import euler_step, step_time
from mstar.models.pi05.graph import ACTION_WALK, PREFIX_CACHE, PREFIX_WALK
from mstar.models.pi05.prefix import PaliGemmaPrefix
from mstar.models.pi05.vision import Pi05Vision

__all__ = ["Pi05LLMNode", "VisionNode", "prefix_tokens"]

_EMPTY = torch.zeros(0)


class VisionNode(NodeSubmodule):
    """``images`` [n_cam, 3, H, W] + ``image_masks`` [n_cam] -> ``image_embeds`` [n_valid * T, width]:
    the valid cameras' tokens, camera after camera."""

    def __init__(self, vision: Pi05Vision) -> None:
        super().__init__()
        self.vision = vision

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        images, masks = inputs["images"][0], inputs["image_masks"][0]
        return NodeInputs(tensor_inputs={"images": images[masks.bool()].float()})

    def forward(self, graph_walk, engine_inputs, images):
        emb = self.vision(images)  # [N, T, width]: every valid camera of the batch in one call
        return {"image_embeds": [e.flatten(0, 1) for e in engine_inputs.split("images", emb)]}


def prefix_tokens(prefix: PaliGemmaPrefix, image_embeds: torch.Tensor, token_ids: torch.Tensor,
                  token_mask: torch.Tensor) -> torch.Tensor:
    """The prefix's input embeddings ``[n, width]``: image tokens, then the valid text tokens scaled."""
    text = prefix.embed_text(token_ids[token_mask.bool()].long())
    return torch.cat([image_embeds.to(text.device, text.dtype), text])


@dataclass(frozen=True)
class _Rows:
    """Where each stack's tokens sit in the batch's token order. ``prefix`` / ``suffix``: their row
    indices, None when the batch has no token of that stack; ``mixed``: the batch has both (else
    one stack's tensors ARE the batch's and no index is applied)."""

    prefix: torch.Tensor | None
    suffix: torch.Tensor | None
    total: int

    @classmethod
    def of(cls, num_tokens: list[int], steps: list[int | None], device: torch.device) -> _Rows:
        kinds = [torch.full((n,), s is not None, dtype=torch.bool, device=device) for n, s in zip(num_tokens, steps)]
        is_suffix = torch.cat(kinds) if kinds else torch.zeros(0, dtype=torch.bool, device=device)
        p, s = (~is_suffix).nonzero().squeeze(1), is_suffix.nonzero().squeeze(1)
        return cls(p if p.numel() else None, s if s.numel() else None, int(is_suffix.numel()))

    @property
    def mixed(self) -> bool:
        return self.prefix is not None and self.suffix is not None

    def take(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, rows) if self.mixed else x

    def merge(self, p: torch.Tensor | None, s: torch.Tensor | None) -> torch.Tensor:
        if not self.mixed:
            return p if p is not None else s
        out = p.new_empty((self.total, *p.shape[1:]))
        out.index_copy_(0, self.prefix, p)
        out.index_copy_(0, self.suffix, s)
        return out


class Pi05LLMNode(NodeSubmodule):
    """PaliGemma's prefix LLM and the action expert over one paged cache per request."""

    def __init__(self, cfg: Pi05Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.prefix = PaliGemmaPrefix(cfg.prefix, cfg.vocab_size)
        self.expert = ActionExpert(cfg)
        p = cfg.prefix
        self.kv_spec = KVSpec(p.depth, p.num_kv_heads, p.head_dim, dtype)
        self._modulations: dict[int, TimeModulation] = {}  # flow step -> every norm's modulation

    def _load_from_state_dict(self, *args, **kwargs):  # new weights: drop what was derived from the old
        self._modulations.clear()
        super()._load_from_state_dict(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return self.prefix.embed_tokens.weight.dtype

    def modulation(self, step: int) -> TimeModulation:
        """The adaptive norms' modulation at flow step ``step`` (computed once per step, then reused:
        it depends on the weights and the step only)."""
        mod = self._modulations.get(step)
        if mod is None:
            with torch.inference_mode():
                mod = self._modulations[step] = self.expert.modulations(step_time(step, self.cfg.num_steps))
        return mod

    @torch.inference_mode()
    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        width, a = self.cfg.prefix.width, self.cfg.action_dim
        if graph_walk == PREFIX_WALK:
            x = prefix_tokens(self.prefix, inputs["image_embeds"][0], inputs["token_ids"][0], inputs["token_mask"][0])
            return NodeInputs({"prefix_x": x, "x_t": torch.zeros(0, a)}, args=None,  # a prefix item: no flow step
                              sequences=[KVSequence(PREFIX_CACHE, x.shape[0], QueryMode.BLOCK_APPEND)])
        if graph_walk != ACTION_WALK:
            raise ValueError(f"pi0.5 prefix module: unknown walk {graph_walk!r}")
        x_t = inputs["actions"][0].float()
        return NodeInputs({"prefix_x": torch.zeros(0, width, dtype=self.dtype), "x_t": x_t},
                          args=fwd_info.iteration[-1],  # its flow step
                          sequences=[KVSequence(PREFIX_CACHE, x_t.shape[0], QueryMode.READ_ONLY)])

    def _row_modulations(self, steps: list[int | None], num_tokens: list[int]) -> list[list[torch.Tensor]]:
        """Per layer ``[input, post_attention]`` and then ``[final]``: each flow item's modulation
        repeated over its tokens, concatenated in batch order."""
        mods = [(self.modulation(s), n) for s, n in zip(steps, num_tokens) if s is not None]
        per_layer = [[torch.cat([m.layers[i][j].expand(n, -1) for m, n in mods]) for j in (0, 1)]
                     for i in range(self.cfg.expert.depth)]
        return per_layer + [[torch.cat([m.final.expand(n, -1) for m, n in mods])]]

    def forward(self, graph_walk, engine_inputs: EngineInputs, prefix_x, x_t):
        ei = engine_inputs
        steps: list[int | None] = ei.args  # per item: its flow step, None for a prefix item
        dev = self.prefix.embed_tokens.weight.device
        rows = _Rows.of(ei.num_tokens, steps, dev)
        prefix_x, x_t, positions = prefix_x.to(dev), x_t.to(dev), ei.positions.to(dev)
        hp = prefix_x if rows.prefix is not None else None
        hs = self.expert.embed(x_t) if rows.suffix is not None else None
        rope_p = self.prefix.rotary.tables(rows.take(positions, rows.prefix)) if hp is not None else None
        rope_s = self.expert.rotary.tables(rows.take(positions, rows.suffix)) if hs is not None else None
        mods = self._row_modulations(steps, ei.num_tokens) if hs is not None else None
        depth = self.cfg.prefix.depth
        for i in range(depth):
            lp, ls = self.prefix.layers[i], self.expert.layers[i]
            qp = kp = vp = qs = ks = vs = gs = None
            if hp is not None:
                qp, kp, vp, _ = lp.qkv(hp, *rope_p)
            if hs is not None:
                qs, ks, vs, gs = ls.qkv(hs, *rope_s, mods[i][0])
            o = paged_attention(rows.merge(qp, qs), rows.merge(kp, ks), rows.merge(vp, vs), *ei.kv_caches[i],
                                ei.attention)
            if hp is not None and i < depth - 1:  # the last layer's K/V are all the prefix is for
                hp = lp.finish(hp, rows.take(o, rows.prefix), None)
            if hs is not None:
                hs = ls.finish(hs, rows.take(o, rows.suffix), gs, mods[i][1])
        return self._outputs(ei, steps, x_t, hs, mods)

    def _outputs(self, ei: EngineInputs, steps, x_t, hs, mods) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {"actions": [_EMPTY] * len(steps), "velocity": [_EMPTY] * len(steps)}
        if hs is None:
            return out
        v = self.expert.velocity(hs, mods[-1][0])
        x_next = euler_step(x_t, v, self.cfg.num_steps)
        flow = [r for r, s in enumerate(steps) if s is not None]
        sizes = [ei.num_tokens[r] for r in flow]
        for r, xr, vr in zip(flow, torch.split(x_next, sizes), torch.split(v, sizes)):
            out["actions"][r], out["velocity"][r] = xr, vr
        return out
