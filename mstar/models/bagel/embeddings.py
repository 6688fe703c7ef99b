"""BAGEL's stateless embedding pieces: the fixed 2D sin-cos table, position and timestep embedders,
patch position ids and patchify helpers.

Layouts follow the checkpoint: a ``PositionEmbedding`` owns ``pos_embed`` ``[max_per_side**2, hidden]``
(a parameter, so checkpoints carry it, but never trained), ``TimestepEmbedder`` owns ``mlp.0`` /
``mlp.2``. A patch at grid row ``r``, column ``c`` has the flat position id ``r * max_per_side + c``,
whatever the image's own width: ids of a smaller image are a sub-grid of the table, never a
re-interpolation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar.layers.prepack import PrepackableLinear

__all__ = [
    "PositionEmbedding",
    "TimestepEmbedder",
    "flattened_position_ids",
    "patchify",
    "sincos_1d",
    "sincos_2d",
    "unpatchify",
]


def sincos_1d(embed_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """``[M, embed_dim]``: ``[sin(pos * omega), cos(pos * omega)]`` with ``omega_k = 10000**(-k / (embed_dim/2))``.

    Computed in float64 and returned as float32 (the table is built once).
    """
    if embed_dim % 2:
        raise ValueError(f"embed_dim must be even, got {embed_dim}")
    half = embed_dim // 2
    omega = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)
    angles = positions.reshape(-1).to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def sincos_2d(embed_dim: int, grid_size: int) -> torch.Tensor:
    """BAGEL's fixed 2D table ``[grid_size**2, embed_dim]``; row ``r * grid_size + c`` is patch (r, c).

    The first ``embed_dim/2`` dims are the 1D embedding of the column index and the last half that of
    the row index. (The reference names its first half "h", but builds the grid with ``meshgrid(w, h)``
    so its first coordinate varies along the columns; this function reproduces its numbers.)
    """
    if embed_dim % 4:
        raise ValueError(f"embed_dim must be a multiple of 4, got {embed_dim}")
    if grid_size < 1:
        raise ValueError(f"grid_size must be >= 1, got {grid_size}")
    idx = torch.arange(grid_size * grid_size)
    rows, cols = idx // grid_size, idx % grid_size
    return torch.cat([sincos_1d(embed_dim // 2, cols), sincos_1d(embed_dim // 2, rows)], dim=1)


class PositionEmbedding(nn.Module):
    """A fixed (non-trainable) ``pos_embed`` ``[max_num_patch_per_side**2, hidden]`` indexed by flat ids."""

    def __init__(self, max_num_patch_per_side: int, hidden_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.max_num_patch_per_side = max_num_patch_per_side
        self.hidden_size = hidden_size
        table = sincos_2d(hidden_size, max_num_patch_per_side)
        self.pos_embed = nn.Parameter(table.to(device=device, dtype=dtype or torch.float32), requires_grad=False)

    def reset_table(self) -> None:
        """Rewrite ``pos_embed`` from the formula (e.g. after building on the meta device)."""
        table = sincos_2d(self.hidden_size, self.max_num_patch_per_side)
        with torch.no_grad():
            self.pos_embed.copy_(table.to(self.pos_embed.dtype))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[position_ids.to(self.pos_embed.device)]


class TimestepEmbedder(nn.Module):
    """Flow time ``t`` (float, any shape ``[N]``) -> ``[N, hidden]``: sinusoid ``[cos, sin]`` then ``mlp``."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            PrepackableLinear(frequency_embedding_size, hidden_size, bias=True, **kw),
            nn.SiLU(),
            PrepackableLinear(hidden_size, hidden_size, bias=True, **kw),
        )

    @staticmethod
    def sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """``[N, dim]`` float32: ``[cos(t f), sin(t f)]`` with ``f_k = max_period**(-k / (dim//2))``
        (a zero column appended when ``dim`` is odd)."""
        half = dim // 2
        k = torch.arange(half, dtype=torch.float32, device=t.device)
        freqs = torch.exp(-math.log(max_period) * k / half)
        args = t.reshape(-1).float()[:, None] * freqs[None, :]
        out = torch.cat([args.cos(), args.sin()], dim=-1)
        if dim % 2:
            out = torch.cat([out, out.new_zeros(out.shape[0], 1)], dim=-1)
        return out

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freq = self.sinusoid(t, self.frequency_embedding_size)
        w = self.mlp[0].weight
        return self.mlp(freq.to(device=w.device, dtype=w.dtype))


def flattened_position_ids(h_pixels: int, w_pixels: int, patch_size: int, max_num_patch_per_side: int,
                           *, device: torch.device | str | None = None) -> torch.Tensor:
    """Flat ids ``row * max_num_patch_per_side + col`` of an image's patches, row-major ``[nh * nw]`` int64.

    Raises when the image is larger than ``max_num_patch_per_side`` patches on a side (its ids would
    wrap into the next row of the table).
    """
    nh, nw = h_pixels // patch_size, w_pixels // patch_size
    if nh < 1 or nw < 1:
        raise ValueError(f"an image of {h_pixels}x{w_pixels} pixels has no whole {patch_size}-pixel patch")
    if nh > max_num_patch_per_side or nw > max_num_patch_per_side:
        raise ValueError(f"an image of {nh}x{nw} patches exceeds the position table "
                         f"({max_num_patch_per_side} patches per side)")
    rows = torch.arange(nh, device=device)
    cols = torch.arange(nw, device=device)
    return (rows[:, None] * max_num_patch_per_side + cols[None, :]).reshape(-1)


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[(H/p) * (W/p), p * p * C]``; patches row-major, each flattened as (p_row, p_col, c)."""
    p = patch_size
    if image.dim() != 3:
        raise ValueError(f"expected an image [C, H, W], got shape {tuple(image.shape)}")
    c, h, w = image.shape
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {p}")
    x = image.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)  # nh, nw, p, p, c
    return x.reshape((h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, patch_size: int, channels: int) -> torch.Tensor:
    """Inverse of ``patchify``: ``[h * w, p * p * C]`` (h, w in patches) -> ``[C, h * p, w * p]``."""
    p = patch_size
    if tokens.shape != (h * w, p * p * channels):
        raise ValueError(f"expected tokens of shape {(h * w, p * p * channels)}, got {tuple(tokens.shape)}")
    x = tokens.reshape(h, w, p, p, channels).permute(4, 0, 2, 1, 3)  # c, h, p, w, p
    return x.reshape(channels, h * p, w * p)
