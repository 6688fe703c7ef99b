"""Bounds the server puts on what a client may send."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 << 20  # larger requests get 413 before their body is read
    max_image_pixels: int = 4096 * 4096  # per decoded input image
