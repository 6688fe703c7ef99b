"""The audio tower's embeddings kept per clip: ``LruStore`` (bounded by bytes, the least recently used
dropped first) and ``feature_key`` (a clip's identity). The tower is stateless and runs one call per
clip (``encoder_nodes.AudioEncoderNode``), so a clip seen again -- a realtime turn's clips, prefilled
while the user speaks and sent again when the turn is answered; a voice chat's earlier turns -- gets
the same embeddings without running it."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable

import torch

__all__ = ["LruStore", "feature_key"]


def feature_key(features: torch.Tensor) -> tuple[int, ...]:
    """A clip's identity: its shape and a digest of its feature bytes."""
    data = features.detach().to("cpu", torch.float32).contiguous()
    return (*data.shape, int.from_bytes(hashlib.blake2b(data.numpy().tobytes(), digest_size=8).digest(), "little"))


class LruStore:
    """Tensors by key, at most ``max_bytes`` in all; the least recently used go first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._items[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()

    def __len__(self) -> int:
        return len(self._items)
