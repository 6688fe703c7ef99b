"""Qwen3-Omni's encoder nodes, before the Thinker (``nodes.py``): transformers' audio and vision towers
(``encoders.py``) as stateless nodes over the batch's clips and images. A request's walks take them
only when it brings audio or images (``graph.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar.model.submodule import EngineInputs, ForwardInfo, NodeInputs, NodeSubmodule
from mstar.models.qwen3_omni.media_cache import LruStore, feature_key

__all__ = ["AudioEncoderNode", "VisionEncoderNode"]


class AudioEncoderNode(NodeSubmodule):
    """``audio_features`` (the request's clips, ``[128, T_i]`` each) -> ``audio_embeds`` ``[sum n_i, H]``:
    one call of the wrapped transformers audio tower per clip. Its output depends on how many clips
    one call holds (in the last bits), and a clip's embeddings must not depend on its batch: they
    are the prefix cache's keys of its placeholders (``nodes.audio_keys``), and outputs are batch
    invariant. A clip's embeddings are kept (``media_cache``, at most ``cache_bytes``) and reused
    when it comes again."""

    def __init__(self, tower: Any, cache_bytes: int = 256 << 20) -> None:
        super().__init__()
        self.tower = tower
        self.cache = LruStore(cache_bytes)

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        return NodeInputs(args=[c.float() for c in inputs["audio_features"]])  # the request's clips

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        clips: list[list[torch.Tensor]] = engine_inputs.args
        return {"audio_embeds": [torch.cat([self._embed(c) for c in per_request]) for per_request in clips]}

    def _embed(self, clip: torch.Tensor) -> torch.Tensor:
        key = feature_key(clip)
        out = self.cache.get(key)
        if out is None:
            out = self.tower([clip])[0]
            self.cache.put(key, out.clone())  # its own storage: the store counts its bytes
        return out


class VisionEncoderNode(NodeSubmodule):
    """``pixel_values`` [N, D] and ``image_grid_thw`` [I, 3] of a request -> ``image_embeds``
    [sum n_i, H] and ``deepstack`` [layers, sum n_i, H] (features added after the Thinker's first layers)."""

    def __init__(self, tower: Any) -> None:
        super().__init__()
        self.tower = tower

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        # the request's images: their patches and grids
        return NodeInputs(args=(inputs["pixel_values"][0].float(), inputs["image_grid_thw"][0].reshape(-1, 3).long()))

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        out: dict[str, list] = {"image_embeds": [], "deepstack": []}
        for pixels, grids in engine_inputs.args:  # one tower call per request (its images batch)
            vision = self.tower(pixels, grids)
            out["image_embeds"].append(torch.cat(vision.embeds))
            out["deepstack"].append(torch.stack([torch.cat(layer) for layer in vision.deepstack]))
        return out
