"""V-JEPA 2-AC in plain PyTorch: the ViT video encoder and the action-conditioned (AC) predictor.

Parameter names equal Meta's state dicts once ``module.`` / ``backbone.`` are stripped (see ``loader``).

RoPE (as the reference computes it, checkpoint-compatible)
----------------------------------------------------------
A head of ``head_dim`` channels is split into three axis slices of ``a = 2 * ((head_dim // 3) // 2)``
channels each -- depth (frame), height, width, in that order -- and the ``head_dim - 3a`` channels left
over are not rotated (ViT-g / AC predictor: head_dim 64 -> 20 + 20 + 20 + 4 unrotated). An axis slice of
``a`` channels at position ``p`` uses ``omega_j = 10000 ** (-j / (a/2))`` for ``j < a/2``; the
reference lays the angles out as ``[p*omega_0 .. p*omega_{a/2-1}, p*omega_0 .. p*omega_{a/2-1}]`` while
rotating *adjacent* channel pairs ``(2i, 2i+1) -> (-x_{2i+1}, x_{2i})`` -- so the two members of a pair use
different angles (a known quirk of the released code, kept because the weights were trained with it).

Positions: the encoder's token ``(t, h, w)`` (t = tubelet index) gets depth ``t``, height ``h``, width
``w``. In the predictor, frame ``t``'s patch tokens get depth ``t``, height ``h * gh / H`` and width
``w * gh / W`` (``gh`` = the config's grid height, ``H, W`` = the grid; both factors are 1 for square
inputs), and its action / state / extrinsics tokens get depth ``t`` on the depth slice only: their height
and width slices are left unrotated. ``t`` is the frame's index in the trajectory (0 for the first frame).

Attention is plain scaled dot product (scale ``head_dim ** -0.5``); the predictor masks it frame-causally:
a token of frame ``t`` sees every token of frames ``0..t`` (its own frame bidirectionally). Since earlier
frames never see later ones, their K/V never change as a trajectory grows, so ``forward_frame`` keeps
them in a cache (``FrameKVCache``) and runs only the new frame's tokens -- exactly what ``forward_full``
computes for that frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.vjepa2.config import EncoderConfig, PredictorConfig, rope_axis_dim, swiglu_hidden

__all__ = [
    "ACPredictor",
    "BlockAttention",
    "FrameKVCache",
    "KVLayer",
    "VJepaEncoder",
    "block_append_attention",
    "encode_frames",
    "rope_tables",
]


# ---------------------------------------------------------------------------------------------------------
# RoPE


def _axis_angles(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Angles [N, dim] for one axis slice of ``dim`` channels, in the reference's layout (see module doc)."""
    half = dim // 2
    omega = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32, device=pos.device) / half)
    freq = pos.to(torch.float32)[:, None] * omega[None, :]
    return torch.cat([freq, freq], dim=-1)


def rope_tables(
    head_dim: int,
    depth: torch.Tensor,
    height: torch.Tensor | None,
    width: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape [N, head_dim] for N tokens with the given per-axis positions.

    ``height`` / ``width`` None: that axis slice is not rotated (the predictor's conditioning tokens).
    Unrotated channels get cos 1, sin 0, so one elementwise rotation covers every token kind.
    """
    a = rope_axis_dim(head_dim)
    n = depth.shape[0]
    angles = torch.zeros(n, head_dim, dtype=torch.float32, device=depth.device)
    angles[:, :a] = _axis_angles(depth, a)
    mask = torch.zeros(n, head_dim, dtype=torch.bool, device=depth.device)
    mask[:, :a] = True
    for i, pos in enumerate((height, width), start=1):
        if pos is not None:
            angles[:, i * a:(i + 1) * a] = _axis_angles(pos, a)
            mask[:, i * a:(i + 1) * a] = True
    cos = torch.where(mask, angles.cos(), torch.ones_like(angles))
    sin = torch.where(mask, angles.sin(), torch.zeros_like(angles))
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` [..., N, head_dim] by the tables [N, head_dim]."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Dense per-layer KV cache (stand-in for the runtime's paged cache in BLOCK_APPEND mode)


@dataclass
class KVLayer:
    """One layer's cached keys / values, each [B, heads, L, head_dim] (RoPE already applied to keys)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)


@dataclass
class FrameKVCache:
    """K/V of the frames a predictor has seen so far, one ``KVLayer`` per block; grows a frame per call."""

    layers: list[KVLayer] = field(default_factory=list)
    num_frames: int = 0

    @classmethod
    def empty(cls, depth: int) -> FrameKVCache:
        return cls(layers=[KVLayer() for _ in range(depth)])

    @property
    def length(self) -> int:
        """Cached tokens per sequence (frames * tokens per frame block)."""
        return self.layers[0].length if self.layers else 0


BlockAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVLayer], torch.Tensor]


def block_append_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           cache_layer: KVLayer) -> torch.Tensor:
    """Append a frame block's K/V to ``cache_layer``, then attend: every new token sees all cached tokens
    and (bidirectionally) every new token. q / k_new / v_new: [B, heads, n, head_dim] -> [B, heads, n, hd].

    This is the only place the cached path touches K/V storage: swap it for the runtime's paged attention
    in ``QueryMode.BLOCK_APPEND`` (``ACPredictor(..., block_attention=...)``).
    """
    cache_layer.append(k_new, v_new)
    assert cache_layer.k is not None and cache_layer.v is not None
    return F.scaled_dot_product_attention(q, cache_layer.k, cache_layer.v)


# ---------------------------------------------------------------------------------------------------------
# Transformer blocks (names: norm1, attn.qkv, attn.proj, norm2, mlp.fc1/fc2[/fc3])


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # fused qkv: output channels are [3, heads, head_dim]
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return self.proj(o.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    def forward_block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layer: KVLayer,
                      attend: BlockAttention) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin)
        return self._out(attend(q, k, v, cache_layer))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, wide_silu: bool) -> None:
        super().__init__()
        inner = swiglu_hidden(hidden, wide_silu)
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(dim, inner)
        self.fc3 = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, qkv_bias: bool, use_silu: bool,
                 wide_silu: bool, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp: nn.Module = SwiGLUMLP(dim, mlp_hidden, wide_silu) if use_silu else GeluMLP(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))

    def forward_block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layer: KVLayer,
                      attend: BlockAttention) -> torch.Tensor:
        x = x + self.attn.forward_block(self.norm1(x), cos, sin, cache_layer, attend)
        return x + self.mlp(self.norm2(x))


# ---------------------------------------------------------------------------------------------------------
# Encoder


class PatchEmbed3D(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        k = (cfg.tubelet_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.embed_dim, kernel_size=k, stride=k)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        return self.proj(video).flatten(2).transpose(1, 2)  # [B, T'*H'*W', D], order (t, h, w)


class VJepaEncoder(nn.Module):
    """ViT video encoder: ``video [B, C, T, H, W] -> tokens [B, (T/tubelet) * (H/p) * (W/p), D]``.

    Output = the reference ``VisionTransformer.forward`` (final LayerNorm applied, no extra normalisation).
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed3D(cfg)
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_hidden, cfg.qkv_bias, cfg.use_silu, cfg.wide_silu,
                  cfg.layernorm_eps)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layernorm_eps)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        if video.ndim != 5:
            raise ValueError(f"expected video [B, C, T, H, W], got shape {tuple(video.shape)}")
        _, _, t, h, w = video.shape
        c = self.cfg
        if t % c.tubelet_size or h % c.patch_size or w % c.patch_size:
            raise ValueError(f"video {t}x{h}x{w} is not a multiple of tubelet {c.tubelet_size} / "
                             f"patch {c.patch_size}")
        gt, gh, gw = t // c.tubelet_size, h // c.patch_size, w // c.patch_size
        dev = video.device
        d, hh, ww = torch.meshgrid(torch.arange(gt, device=dev), torch.arange(gh, device=dev),
                                   torch.arange(gw, device=dev), indexing="ij")
        cos, sin = rope_tables(c.head_dim, d.flatten(), hh.flatten(), ww.flatten())
        x = self.patch_embed(video)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.norm(x)


def encode_frames(encoder: VJepaEncoder, frames: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Encode each frame on its own, as the AC world model does: ``frames [B, T, C, H, W] -> [B, T*N, D]``.

    Every frame is repeated ``tubelet_size`` times along time (one tubelet), encoded, and, with
    ``normalize``, layer-normed without affine parameters (eps 1e-5) -- the reference world-model wrapper's
    ``normalize_reps``; predictor outputs fed back during a rollout are normalised the same way.
    """
    b, t = frames.shape[:2]
    clips = frames.flatten(0, 1).unsqueeze(2).repeat(1, 1, encoder.cfg.tubelet_size, 1, 1)
    h = encoder(clips)  # [B*T, N, D]
    h = h.view(b, t * h.shape[1], h.shape[2])
    return F.layer_norm(h, (h.shape[-1],)) if normalize else h


# ---------------------------------------------------------------------------------------------------------
# Action-conditioned predictor


class ACPredictor(nn.Module):
    """V-JEPA 2-AC predictor. Per frame the sequence holds [action, state, (extrinsics), H*W patch tokens].

    ``forward_full``: a whole trajectory under the frame-causal mask (= reference ``forward``).
    ``forward_frame``: one frame appended to a ``FrameKVCache``; returns that frame's predicted tokens.
    """

    def __init__(self, cfg: PredictorConfig, block_attention: BlockAttention = block_append_attention) -> None:
        super().__init__()
        self.cfg = cfg
        self.block_attention = block_attention
        d = cfg.predictor_embed_dim
        self.predictor_embed = nn.Linear(cfg.embed_dim, d)
        self.action_encoder = nn.Linear(cfg.action_dim, d)
        self.state_encoder = nn.Linear(cfg.action_dim, d)
        # present in every checkpoint, used only with use_extrinsics
        self.extrinsics_encoder = nn.Linear(cfg.action_dim - 1, d)
        self.predictor_blocks = nn.ModuleList(
            Block(d, cfg.num_heads, cfg.mlp_hidden, cfg.qkv_bias, cfg.use_silu, cfg.wide_silu, cfg.layernorm_eps)
            for _ in range(cfg.depth)
        )
        self.predictor_norm = nn.LayerNorm(d, eps=cfg.layernorm_eps)
        self.predictor_proj = nn.Linear(d, cfg.embed_dim)

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

    def new_cache(self) -> FrameKVCache:
        return FrameKVCache.empty(self.cfg.depth)

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

    def forward_frame(self, frame_tokens: torch.Tensor, action: torch.Tensor, state: torch.Tensor,
                      frame_index: int, cache: FrameKVCache,
                      extrinsics: torch.Tensor | None = None) -> torch.Tensor:
        """Run one frame against the cached earlier frames and append it to ``cache``.

        frame_tokens [B, N, D_enc], action / state [B, action_dim] (extrinsics [B, action_dim - 1]) ->
        the frame's predictions [B, N, D_enc] (= the last frame of ``forward_full`` over frames
        0..frame_index). ``frame_index`` must equal the number of frames already cached.
        """
        if frame_index != cache.num_frames:
            raise ValueError(f"frame_index {frame_index} but the cache holds {cache.num_frames} frames: "
                             "frames must be appended in order, starting at 0")
        if len(cache.layers) != self.cfg.depth:
            raise ValueError(f"cache has {len(cache.layers)} layers, predictor has {self.cfg.depth}")
        ext = None if extrinsics is None else extrinsics.unsqueeze(1)
        x = self._embed_frames(frame_tokens.unsqueeze(1), action.unsqueeze(1), state.unsqueeze(1), ext)
        b = x.shape[0]
        x = x.flatten(1, 2)
        cos, sin = self._frame_rope(frame_index, x.device)
        for blk, layer in zip(self.predictor_blocks, cache.layers, strict=True):
            x = blk.forward_block(x, cos, sin, layer, self.block_attention)
        cache.num_frames += 1
        return self._readout(x.view(b, 1, self.cfg.block_tokens, -1))
