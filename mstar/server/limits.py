"""Bounds the server puts on what a client may send."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 << 20  # larger requests get 413 before their body is read
    max_image_pixels: int = 4096 * 4096  # per decoded input image, checked from its header
    max_image_side: int = 16384  # per side of an input image, and of a requested output size
    max_images: int = 16  # image parts of one chat request
    max_audio_samples: int = 24000 * 600  # per input clip: ten minutes at 24 kHz
    max_audio_clips: int = 16  # audio parts of one chat request
    max_tensor_elements: int = 1 << 26  # per input tensor of /generate
    max_tensor_dims: int = 8
