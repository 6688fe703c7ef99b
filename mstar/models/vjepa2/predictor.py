"""V-JEPA 2-AC's action-conditioned predictor: a whole trajectory under the frame-causal mask (served
rollouts run its blocks row by row over the runtime's paged cache).

Parameter names equal Meta's state dicts once ``module.`` / ``backbone.`` are stripped (see ``loader``);
token positions: ``rope.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.prepack import PrepackableLinear
from mstar.models.vjepa2.blocks import Block
from mstar.models.vjepa2.config import PredictorConfig
from mstar.models.vjepa2.rope import rope_tables

__all__ = ["ACPredictor"]


class ACPredictor(nn.Module):
    """V-JEPA 2-AC predictor. Per frame the sequence holds [action, state, (extrinsics), H*W patch tokens].

    ``forward_full``: a whole trajectory under the frame-causal mask (= reference ``forward``).
    """

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.predictor_embed_dim
        self.predictor_embed = PrepackableLinear(cfg.embed_dim, d)
        self.action_encoder = PrepackableLinear(cfg.action_dim, d)
        self.state_encoder = PrepackableLinear(cfg.action_dim, d)
        # present in every checkpoint, used only with use_extrinsics
        self.extrinsics_encoder = PrepackableLinear(cfg.action_dim - 1, d)
        self.predictor_blocks = nn.ModuleList(
            Block(d, cfg.num_heads, cfg.mlp_hidden, cfg.qkv_bias, cfg.use_silu, cfg.wide_silu, cfg.layernorm_eps)
            for _ in range(cfg.depth)
        )
        self.predictor_norm = nn.LayerNorm(d, eps=cfg.layernorm_eps)
        self.predictor_proj = PrepackableLinear(d, cfg.embed_dim)

    # -- positions ------------------------------------------------------------------------------------
    def _frame_rope(self, frame_index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [block_tokens, head_dim] of one frame: conditioning tokens, then patches row-major."""
        c = self.cfg
        gh, gw = c.grid
        k = c.cond_tokens
        cond_cos, cond_sin = rope_tables(c.head_dim, torch.full((k,), frame_index, device=device), None, None)
        hh, ww = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
        # the reference snaps spatial positions to its grid height: h * gh / H, w * gh / W
        # (height factor gh / gh = 1; the width factor is 1 only for square grids)
        hpos = hh.flatten().to(torch.float32)
        wpos = ww.flatten().to(torch.float32) * (gh / gw)
        depth = torch.full((gh * gw,), frame_index, device=device)
        p_cos, p_sin = rope_tables(c.head_dim, depth, hpos, wpos)
        return torch.cat([cond_cos, p_cos]), torch.cat([cond_sin, p_sin])

    def _embed_frames(self, tokens: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                      extrinsics: torch.Tensor | None) -> torch.Tensor:
        """tokens [B, T, N, D_enc], actions/states [B, T, A] -> [B, T, K+N, D_pred]."""
        c = self.cfg
        parts = [self.action_encoder(actions).unsqueeze(2), self.state_encoder(states).unsqueeze(2)]
        if c.use_extrinsics:
            if extrinsics is None:
                raise ValueError("this predictor uses extrinsics: pass extrinsics [B, T, action_dim - 1]")
            parts.append(self.extrinsics_encoder(extrinsics).unsqueeze(2))
        parts.append(self.predictor_embed(tokens))
        return torch.cat(parts, dim=2)

    def _readout(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, K+N, D_pred] -> patch predictions [B, T*N, D_enc]."""
        x = x[:, :, self.cfg.cond_tokens:].flatten(1, 2)
        return self.predictor_proj(self.predictor_norm(x))


    # -- entry points ---------------------------------------------------------------------------------
    def forward_full(self, tokens: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                     extrinsics: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T*N, D_enc], actions / states [B, T, action_dim] -> predictions [B, T*N, D_enc]."""
        c = self.cfg
        b, total, _ = tokens.shape
        n = c.tokens_per_frame
        if total % n:
            raise ValueError(f"{total} tokens is not a whole number of {n}-token frames")
        t = total // n
        if actions.shape[:2] != (b, t) or states.shape[:2] != (b, t):
            raise ValueError(f"actions / states must be [B={b}, T={t}, {c.action_dim}], got "
                             f"{tuple(actions.shape)} / {tuple(states.shape)}")
        x = self._embed_frames(tokens.view(b, t, n, -1), actions, states, extrinsics)
        kb = c.block_tokens
        x = x.flatten(1, 2)
        tables = [self._frame_rope(i, x.device) for i in range(t)]
        cos = torch.cat([tc for tc, _ in tables])
        sin = torch.cat([ts for _, ts in tables])
        frame_of = torch.arange(t, device=x.device).repeat_interleave(kb)
        mask = frame_of[:, None] >= frame_of[None, :]  # True = may attend (frame-causal, blocks bidirectional)
        for blk in self.predictor_blocks:
            x = blk(x, cos, sin, mask)
        return self._readout(x.view(b, t, kb, -1))
