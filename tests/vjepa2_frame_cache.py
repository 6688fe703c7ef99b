"""A dense frame cache for V-JEPA 2-AC's predictor, the tests' stand-in for the runtime's paged one:
per layer, the keys / values of every frame seen so far, and ``forward_frame``, one frame run against
them with the predictor's own modules. Under the frame-causal mask earlier frames never see later
ones, so their K/V never change as a trajectory grows: caching them and running only the new frame's
tokens is exact, which the tests check against ``ACPredictor.forward_full``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mstar.models.vjepa2.predictor import ACPredictor

__all__ = ["FrameKVCache", "KVLayer", "block_append_attention", "forward_frame"]


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


def block_append_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           cache_layer: KVLayer) -> torch.Tensor:
    """Append a frame block's K/V to ``cache_layer``, then attend: every new token sees all cached tokens
    and (bidirectionally) every new token. q / k_new / v_new: [B, heads, n, head_dim] -> [B, heads, n, hd].

    """
    cache_layer.append(k_new, v_new)
    assert cache_layer.k is not None and cache_layer.v is not None
    return F.scaled_dot_product_attention(q, cache_layer.k, cache_layer.v)


def forward_frame(predictor: ACPredictor, frame_tokens: torch.Tensor, action: torch.Tensor, state: torch.Tensor,
                  frame_index: int, cache: FrameKVCache, extrinsics: torch.Tensor | None = None) -> torch.Tensor:
    """Run one frame against the cached earlier frames and append it to ``cache``.

    frame_tokens [B, N, D_enc], action / state [B, action_dim] (extrinsics [B, action_dim - 1]) -> the
    frame's predictions [B, N, D_enc] (= the last frame of ``forward_full`` over frames 0..frame_index).
    ``frame_index`` must equal the number of frames already cached.
    """
    if frame_index != cache.num_frames:
        raise ValueError(f"frame_index {frame_index} but the cache holds {cache.num_frames} frames: "
                         "frames must be appended in order, starting at 0")
    if len(cache.layers) != predictor.cfg.depth:
        raise ValueError(f"cache has {len(cache.layers)} layers, predictor has {predictor.cfg.depth}")
    ext = None if extrinsics is None else extrinsics.unsqueeze(1)
    x = predictor._embed_frames(frame_tokens.unsqueeze(1), action.unsqueeze(1), state.unsqueeze(1), ext)
    b = x.shape[0]
    x = x.flatten(1, 2)
    cos, sin = predictor._frame_rope(frame_index, x.device)
    for blk, layer in zip(predictor.predictor_blocks, cache.layers, strict=True):
        q, k, v = blk.attn._qkv(blk.norm1(x), cos, sin)
        x = x + blk.attn._out(block_append_attention(q, k, v, layer))
        x = x + blk.mlp(blk.norm2(x))
    cache.num_frames += 1
    return predictor._readout(x.view(b, 1, predictor.cfg.block_tokens, -1))
