"""Qwen3-Omni's input encoders: request media -> model features -> Thinker embeddings.

Preprocessing (pure functions, run by the API adapter when a request arrives):

* :func:`audio_input`: PCM at any rate -> mono float -> the extractor's rate (:func:`resample`, a
  Hann-windowed sinc) -> log-mel features with transformers' ``WhisperFeatureExtractor`` at the
  checkpoint's settings (``media.AudioSettings``: 128 bins, n_fft 400, hop 160 unless its
  ``preprocessor_config.json`` says otherwise; no truncation) -> :class:`AudioInput`, whose
  ``num_tokens`` is the audio tower's output length (:func:`audio_token_count`);
* :func:`image_input`: uint8 ``[H, W, 3]`` -> transformers' Qwen2-VL image processor at the
  checkpoint's settings (``media.ImageSettings``: patch, temporal patch, merge size, mean / std and
  pixel budget) -> :class:`ImageInput` (patches, ``grid_thw``, ``num_tokens``).

Towers (stateless batched modules wrapping transformers' classes, weights ``thinker.audio_tower.*``
and ``thinker.visual.*``):

* :class:`AudioTower`: ``forward(list of [128, T_i]) -> list of [n_i, H]``, all clips in one call;
* :class:`VisionTower`: ``forward(patches [N, D], grid_thw [I, 3]) -> VisionOutput`` (per-image
  embeddings and the deepstack features added after the Thinker's first layers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.checkpoint import load_into
from mstar.models.qwen3_omni.media import AudioSettings, ImageSettings

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "AudioInput",
    "AudioTower",
    "ImageInput",
    "VisionOutput",
    "VisionTower",
    "audio_input",
    "audio_token_count",
    "image_input",
    "resample",
]

DEFAULT_AUDIO, DEFAULT_IMAGE = AudioSettings(), ImageSettings()  # the tiny model's (no preprocessor_config.json)
AUDIO_SAMPLE_RATE = DEFAULT_AUDIO.sampling_rate  # Qwen3-Omni's feature extractor rate (a checkpoint may say another)


@dataclass(frozen=True)
class AudioInput:
    """One clip's features ``[mel bins, T]`` (float32) and the number of placeholder tokens it takes."""

    features: torch.Tensor
    num_tokens: int


@dataclass(frozen=True)
class ImageInput:
    """One image's patches ``[N, 3 * temporal patch * patch * patch]``, its ``grid_thw`` ``[3]`` and
    placeholder count."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    num_tokens: int


# ---------------------------------------------------------------------------------------- audio


def _sinc_kernels(orig: int, new: int, zeros: int) -> tuple[torch.Tensor, int]:
    """Per output phase, the low-pass interpolation filter over input taps (``[new, taps]``) and the
    one-sided tap reach ``reach``."""
    cutoff = 0.99 * min(orig, new)  # a little below Nyquist of the lower rate
    reach = math.ceil(zeros * orig / cutoff)
    taps = torch.arange(-reach, reach + orig, dtype=torch.float64) / orig
    t = (taps[None, :] - torch.arange(new, dtype=torch.float64)[:, None] / new) * cutoff
    t = t.clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / (2 * zeros)) ** 2
    arg = t * math.pi
    sinc = torch.where(arg == 0, torch.ones_like(arg), torch.sin(arg) / arg)
    return (sinc * window * cutoff / orig).to(torch.float32), reach


def resample(wave: torch.Tensor, orig_rate: int, new_rate: int, zeros: int = 16) -> torch.Tensor:
    """Band-limited resampling of a 1-D float waveform (Hann-windowed sinc, ``zeros`` zero crossings
    each side); ``ceil(len * new / orig)`` samples."""
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} and {new_rate}")
    if orig_rate == new_rate:
        return wave.float()
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernels, reach = _sinc_kernels(orig, new, zeros)
    x = F.pad(wave.float()[None, None], (reach, reach + orig))
    out = F.conv1d(x, kernels[:, None], stride=orig)  # [1, new, steps]: phase-major
    length = math.ceil(wave.shape[-1] * new / orig)
    return out[0].transpose(0, 1).reshape(-1)[:length]


def audio_token_count(num_frames: int, n_window: int = 50) -> int:
    """The audio tower's output length for ``num_frames`` mel frames: each full ``2 * n_window``
    window gives 13 tokens, the rest goes through three stride-2 convolutions."""
    window = 2 * n_window
    rest = num_frames % window
    after_conv1 = (rest - 1) // 2 + 1
    return ((after_conv1 - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // window) * 13


@cache
def _feature_extractor(settings: AudioSettings) -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=settings.feature_size, sampling_rate=settings.sampling_rate,
                                   hop_length=settings.hop_length, n_fft=settings.n_fft,
                                   chunk_length=settings.chunk_length, padding_value=settings.padding_value,
                                   dither=settings.dither)


def _mono_float(pcm: torch.Tensor) -> torch.Tensor:
    wave = pcm.float() / 32768.0 if pcm.dtype == torch.int16 else pcm.float()
    return wave.mean(dim=-1) if wave.dim() == 2 else wave.reshape(-1)


def audio_input(pcm: torch.Tensor, sample_rate: int, n_window: int = 50,
                settings: AudioSettings = DEFAULT_AUDIO) -> AudioInput:
    """Mono or ``[samples, channels]`` PCM (int16 or float) -> :class:`AudioInput`."""
    rate = settings.sampling_rate
    wave = resample(_mono_float(pcm), int(sample_rate), rate)
    if wave.numel() < settings.min_samples:
        raise ValueError(f"input_audio is too short: {wave.numel()} samples at {rate} Hz, at least "
                         f"{settings.min_samples} needed")
    out = _feature_extractor(settings)(wave.numpy(), sampling_rate=rate, return_attention_mask=True,
                                       padding="longest", truncation=False, return_tensors="pt")
    frames = int(out["attention_mask"][0].sum())
    features = out["input_features"][0, :, :frames].float()
    return AudioInput(features=features, num_tokens=audio_token_count(frames, n_window))


# ---------------------------------------------------------------------------------------- images


@cache
def _image_processor(settings: ImageSettings) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=settings.patch_size, temporal_patch_size=settings.temporal_patch_size,
                                    merge_size=settings.merge_size, image_mean=list(settings.image_mean),
                                    image_std=list(settings.image_std), min_pixels=settings.min_pixels,
                                    max_pixels=settings.max_pixels)


def image_input(pixels: torch.Tensor, settings: ImageSettings = DEFAULT_IMAGE) -> ImageInput:
    """uint8 ``[H, W, 3]`` -> :class:`ImageInput` (resized so both sides are multiples of patch x merge,
    within the pixel budget)."""
    if pixels.dim() != 3 or pixels.shape[-1] != 3 or pixels.dtype != torch.uint8:
        raise ValueError(f"an image must be uint8 [H, W, 3], got {pixels.dtype} {tuple(pixels.shape)}")
    out = _image_processor(settings)(images=[pixels.numpy()], return_tensors="pt")
    grid = out["image_grid_thw"][0].long()
    return ImageInput(pixel_values=out["pixel_values"].float(), grid_thw=grid,
                      num_tokens=int(grid.prod()) // settings.merge_size ** 2)


# ---------------------------------------------------------------------------------------- towers


def _load(module: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> None:
    own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    load_into(module, own, what=f"checkpoint '{prefix}*' tensors")


class AudioTower(nn.Module):
    """transformers' ``Qwen3OmniMoeAudioEncoder`` over a batch of clips."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
            Qwen3OmniMoeAudioEncoderConfig,
        )
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

        cfg = config if not isinstance(config, Mapping) else Qwen3OmniMoeAudioEncoderConfig(**config)
        self.encoder = Qwen3OmniMoeAudioEncoder(cfg).eval()

    def load_weights(self, state: Mapping[str, torch.Tensor], prefix: str = "thinker.audio_tower.") -> None:
        _load(self.encoder, state, prefix)

    @torch.inference_mode()
    def forward(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per clip ``[128, T_i]`` -> its embeddings ``[audio_token_count(T_i), H]``."""
        device = next(self.encoder.parameters()).device
        lens = torch.tensor([f.shape[-1] for f in features], dtype=torch.long, device=device)
        packed = torch.cat([f.to(device) for f in features], dim=-1)
        out = self.encoder(packed, feature_lens=lens).last_hidden_state
        sizes = [audio_token_count(int(n), self.encoder.n_window) for n in lens.tolist()]
        return list(out.split(sizes))


@dataclass(frozen=True)
class VisionOutput:
    """Per image: embeddings ``[n_i, H]`` and, per deepstack layer, features ``[n_i, H]``."""

    embeds: list[torch.Tensor]
    deepstack: list[list[torch.Tensor]]


class VisionTower(nn.Module):
    """transformers' ``Qwen3OmniMoeVisionEncoder`` over a batch of images."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
            Qwen3OmniMoeVisionEncoderConfig,
        )
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

        cfg = config if not isinstance(config, Mapping) else Qwen3OmniMoeVisionEncoderConfig(**config)
        self.encoder = Qwen3OmniMoeVisionEncoder(cfg).eval()

    def load_weights(self, state: Mapping[str, torch.Tensor], prefix: str = "thinker.visual.") -> None:
        _load(self.encoder, state, prefix)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        device = next(self.encoder.parameters()).device
        out = self.encoder(pixel_values.to(device), grid_thw=grid_thw.to(device))
        sizes = (grid_thw.prod(-1) // self.encoder.spatial_merge_size ** 2).tolist()
        return VisionOutput(embeds=list(out.pooler_output.split(sizes)),
                            deepstack=[list(f.split(sizes)) for f in out.deepstack_features])
