"""pi0.5's architecture configs and the typed request its walks take.

``PI05_BASE`` is ``lerobot/pi05_base`` (SigLIP So400m/14 at 224 px, PaliGemma's Gemma-2B prefix,
the Gemma-300M action expert with adaRMS time conditioning); ``PI05_TINY`` the offline test size
the parity fixture uses. Both experts must share depth, heads, KV heads and head_dim: their
attention is joined layer by layer (the suffix attends to the prefix's K/V of the same layer).

``Pi05Request`` is what a caller (the HTTP adapter, the policy server, a test) hands the model:
already-normalised images and token ids. Turning raw observations into one (resize with padding,
[-1, 1] scaling, the state prompt, tokenisation) happens before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mstar.model.validation import check_int

__all__ = ["PI05_BASE", "PI05_TINY", "GemmaConfig", "Pi05Config", "Pi05Request", "VisionConfig"]


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma stack (the PaliGemma prefix LLM or the action expert)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for name in ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
            check_int(getattr(self, name), f"GemmaConfig.{name}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"GemmaConfig: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"GemmaConfig: head_dim must be even (rotary halves), got {self.head_dim}")


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP tower (no pooling head) and its projector into the prefix width."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int = 14
    image_size: int = 224
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size", "image_size"):
            check_int(getattr(self, name), f"VisionConfig.{name}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"VisionConfig: hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                             f"({self.num_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"VisionConfig: image_size ({self.image_size}) must be a multiple of patch_size "
                             f"({self.patch_size})")

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class Pi05Config:
    """The whole policy: vision tower, prefix LLM, action expert and the flow settings."""

    vision: VisionConfig
    prefix: GemmaConfig
    expert: GemmaConfig
    vocab_size: int = 257_152
    action_dim: int = 32  # max_action_dim: actions are padded to it, clients slice their robot's dims
    horizon: int = 50  # chunk_size: action tokens per request
    num_steps: int = 10  # Euler steps of the flow, from t=1 (noise) to t=0
    min_period: float = 4e-3
    max_period: float = 4.0
    max_cameras: int = 3
    max_text_tokens: int = 200  # tokenizer_max_length

    def __post_init__(self) -> None:
        for name in ("vocab_size", "action_dim", "horizon", "num_steps", "max_cameras", "max_text_tokens"):
            check_int(getattr(self, name), f"Pi05Config.{name}")
        p, e = self.prefix, self.expert
        for name in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(p, name) != getattr(e, name):
                raise ValueError(f"Pi05Config: prefix and expert must share {name} (joint attention), got "
                                 f"{getattr(p, name)} and {getattr(e, name)}")
        if not 0 < self.min_period < self.max_period:
            raise ValueError("Pi05Config: need 0 < min_period < max_period")
        if self.expert.width % 2:
            raise ValueError("Pi05Config: the expert width must be even (sin/cos time embedding)")


PI05_BASE = Pi05Config(
    vision=VisionConfig(hidden_size=1152, intermediate_size=4304, num_layers=27, num_heads=16),
    prefix=GemmaConfig(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
    expert=GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
)

# The parity fixture's size (tests/fixtures/pi05): 56 px images (16 tokens each), vocab 1024.
PI05_TINY = Pi05Config(
    vision=VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=56),
    prefix=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
    expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
    vocab_size=1024,
)


@dataclass(frozen=True)
class Pi05Request:
    """One observation, ready for the model (the runtime-level request of ``pi05`` / ``pi05-tiny``).

    Fields:
      images: float32 ``[n_cam, 3, H, W]``, values in [-1, 1], ``H = W = vision.image_size``;
        1 <= n_cam <= ``max_cameras`` (camera order is the checkpoint's: base, left wrist, right wrist).
      image_masks: bool ``[n_cam]``, False for a missing camera (its image is ignored: send -1s).
        At least one camera must be valid.
      token_ids: int64 ``[L]``, the prompt's token ids (BOS first), ``L <= max_text_tokens``; right
        padding is allowed.
      token_mask: bool ``[L]`` (None: every token is real), False for padding.
      noise: float32 ``[horizon, action_dim]``, the flow's starting point x_1 (None: drawn from
        ``seed``).
      seed: the noise seed when ``noise`` is None (None: a random one).

    The model answers ``actions``: float32 ``[horizon, action_dim]``, the model's (normalised) action
    chunk; un-normalising and slicing to the robot's dims happen after it.
    """

    images: torch.Tensor
    image_masks: torch.Tensor
    token_ids: torch.Tensor
    token_mask: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    seed: int | None = None

    def to_runtime(self) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
        """``(inputs, params)`` for ``Runtime.submit`` / the native ``/generate`` route."""
        mask = self.token_mask if self.token_mask is not None else torch.ones(self.token_ids.shape, dtype=torch.bool)
        inputs = {"images": [self.images], "image_masks": [self.image_masks], "token_ids": [self.token_ids],
                  "token_mask": [mask]}
        if self.noise is not None:
            inputs["noise"] = [self.noise]
        params: dict[str, Any] = {} if self.seed is None else {"seed": self.seed}
        return inputs, params

    @classmethod
    def from_runtime(cls, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> Pi05Request:
        """The request of ``Runtime.submit``'s inputs (the first value of each name)."""
        def first(name: str) -> Any:
            values = inputs.get(name)
            return values[0] if values else None

        return cls(images=first("images"), image_masks=first("image_masks"), token_ids=first("token_ids"),
                   token_mask=first("token_mask"), noise=first("noise"), seed=params.get("seed"))
