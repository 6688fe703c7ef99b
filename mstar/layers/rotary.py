"""Rotary position embedding (RoPE) in the Hugging Face Llama convention.

The head dimension is split in two halves (not interleaved pairs): for a vector ``x`` of size
``D``, ``rotate_half(x) = cat(-x[D/2:], x[:D/2])`` and the rotated vector is
``x * cos + rotate_half(x) * sin``, where ``cos``/``sin`` of position ``p`` are
``cos(p * inv_freq)`` repeated twice along the last dimension.

Supported frequency schedules (``RopeScaling.rope_type``):

* ``default`` (no scaling object): ``inv_freq[i] = theta ** (-2i / D)``;
* ``linear``: every inverse frequency divided by ``factor``;
* ``llama3``: Llama 3.1's wavelength-dependent schedule. With ``L = original_max_position_embeddings``,
  frequencies whose wavelength is shorter than ``L / high_freq_factor`` are kept, those longer than
  ``L / low_freq_factor`` are divided by ``factor``, and the ones in between are blended linearly in
  ``L / wavelength``.

cos/sin are computed in float32 from positions given explicitly (int64 ``[T]``, one per token of a
flat batch) and only then cast to the activations' dtype, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "RopeScaling",
    "RotaryEmbedding",
    "apply_rotary",
    "compute_inv_freq",
    "parse_rope_scaling",
    "rotate_half",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency schedule other than the default one (hashable, picklable)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if not isinstance(self.factor, (int, float)) or isinstance(self.factor, bool) or self.factor <= 0:
            raise ValueError(f"rope scaling factor must be a number > 0, got {self.factor!r}")
        object.__setattr__(self, "factor", float(self.factor))
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings is None or self.original_max_position_embeddings < 1:
                raise ValueError("llama3 rope scaling needs original_max_position_embeddings >= 1, got "
                                 f"{self.original_max_position_embeddings!r}")
            if self.high_freq_factor == self.low_freq_factor:
                raise ValueError("llama3 rope scaling needs high_freq_factor != low_freq_factor "
                                 f"(both are {self.low_freq_factor})")
            if self.low_freq_factor <= 0 or self.high_freq_factor <= 0:
                raise ValueError("llama3 rope scaling factors must be > 0")
            object.__setattr__(self, "low_freq_factor", float(self.low_freq_factor))
            object.__setattr__(self, "high_freq_factor", float(self.high_freq_factor))
            object.__setattr__(self, "original_max_position_embeddings",
                               int(self.original_max_position_embeddings))

    def to_dict(self) -> dict[str, Any]:
        """The HF ``rope_parameters`` / ``rope_scaling`` fields of this schedule (without ``rope_theta``)."""
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                     original_max_position_embeddings=self.original_max_position_embeddings)
        return d


def parse_rope_scaling(d: Mapping[str, Any] | None, max_position_embeddings: int | None = None
                       ) -> RopeScaling | None:
    """A ``RopeScaling`` from an HF ``rope_scaling`` / ``rope_parameters`` dict; None for the default
    schedule.

    The type is read from ``rope_type`` (or the legacy ``type``). For ``llama3`` a missing
    ``original_max_position_embeddings`` falls back to ``max_position_embeddings`` as in transformers.
    """
    if not d:
        return None
    if not isinstance(d, Mapping):
        raise ValueError(f"rope scaling must be a mapping, got {type(d).__name__}")
    rope_type = d.get("rope_type", d.get("type")) or "default"
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if "factor" not in d:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeScaling("linear", d["factor"])
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in d]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    orig = d.get("original_max_position_embeddings") or max_position_embeddings
    return RopeScaling("llama3", d["factor"], d["low_freq_factor"], d["high_freq_factor"], orig)


def compute_inv_freq(head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies of the schedule (the exact transformers values)."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rotary head_dim must be even and >= 2, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: per-frequency treatment by wavelength relative to the pre-training context
    ctx = scaling.original_max_position_embeddings
    lo, hi, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    long_wavelen = ctx / lo  # longer than this: fully scaled
    short_wavelen = ctx / hi  # shorter than this: untouched
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    blend = (ctx / wavelen - lo) / (hi - lo)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = ~(wavelen < short_wavelen) * ~(wavelen > long_wavelen)
    return torch.where(in_between, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by per-token ``cos``/``sin`` ``[T, D]``."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for explicit absolute positions.

    The inverse frequencies stay float32 whatever dtype the surrounding model is cast to (they are
    kept outside the module's buffers, with one copy per device they are used on).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = float(theta)
        self.scaling = scaling
        self._inv_freq = {torch.device("cpu"): compute_inv_freq(head_dim, theta, scaling)}

    @property
    def inv_freq(self) -> torch.Tensor:
        return self._inv_freq[torch.device("cpu")]

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        inv = self._inv_freq.get(device)
        if inv is None:
            inv = self._inv_freq[device] = self.inv_freq.to(device)
        return inv

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, head_dim]`` in ``dtype`` for int positions ``[T]``."""
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D [tokens], got shape {tuple(positions.shape)}")
        device = torch.device(device) if device is not None else positions.device
        pos = positions.to(device=device, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq_on(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"
