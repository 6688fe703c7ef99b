"""The predictor's dense frame cache: per layer, the keys / values of every frame seen so far.

A stand-in for the runtime's paged cache in ``QueryMode.BLOCK_APPEND``, used by
``ACPredictor.forward_frame`` (the tests check it against ``forward_full``; served rollouts use the
paged cache). Under the frame-causal mask earlier frames never see later ones, so their K/V never
change as a trajectory grows: caching them and running only the new frame's tokens is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["BlockAttention", "FrameKVCache", "KVLayer", "block_append_attention"]


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
