"""3D rotary position embedding of V-JEPA 2: tables per token position, and the rotation.

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
"""

from __future__ import annotations

import torch

from mstar.models.vjepa2.config import rope_axis_dim

__all__ = ["rope_tables", "rotate"]


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` [..., N, head_dim] by the tables [N, head_dim]."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)
