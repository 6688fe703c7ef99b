"""The media preprocessing settings of a Qwen3-Omni checkpoint: its ``preprocessor_config.json``.

A checkpoint carries one file for both processors (transformers' ``Qwen3OmniMoeProcessor`` saves the
image processor's and the audio feature extractor's keys side by side). mstar reads the keys that
change the tensors it builds and hands them to the same transformers classes the reference uses
(``encoders.image_input`` / ``audio_input``):

* images (``Qwen2VLImageProcessor``): ``patch_size``, ``temporal_patch_size``, ``merge_size``,
  ``image_mean``, ``image_std``, and the pixel budget ``min_pixels`` / ``max_pixels`` (or the
  ``size`` dict's ``shortest_edge`` / ``longest_edge``, which they override, as in transformers);
* audio (``WhisperFeatureExtractor``): ``feature_size`` (mel bins), ``sampling_rate``, ``hop_length``,
  ``n_fft``, ``chunk_length``, ``padding_value``, ``dither``.

A key the file does not hold keeps the class default (``ImageSettings`` / ``AudioSettings``: the
processors' own defaults, which the tiny config is built for); a checkpoint without the file gets
all defaults. The sizes must agree with the towers' config (``check_against``): a processor that
cuts 14-pixel patches for a tower built for 16 is refused at load, not discovered as wrong answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mstar.model.checkpoint import CheckpointError
from mstar.model.validation import check_int
from mstar.models.llama.config import read_json

__all__ = ["PREPROCESSOR_FILE", "AudioSettings", "ImageSettings", "MediaSettings"]

PREPROCESSOR_FILE = "preprocessor_config.json"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2VLImageProcessor's defaults (OpenAI CLIP's)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSettings:
    """What ``Qwen2VLImageProcessor`` is built with (its defaults, but patch 16 as Qwen3-Omni's tower)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            check_int(getattr(self, name), name)
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != 3 or not all(isinstance(v, float) and math.isfinite(v) for v in value):
                raise ValueError(f"{name} must be three finite numbers, got {list(value)}")
        if min(self.image_std) <= 0:
            raise ValueError(f"image_std must be positive, got {list(self.image_std)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")

    @property
    def patch_dim(self) -> int:
        """Values per patch row: 3 channels x temporal patch x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True)
class AudioSettings:
    """What ``WhisperFeatureExtractor`` is built with (Qwen3-Omni's values: 128 mel bins at 16 kHz)."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 300
    padding_value: float = 0.0
    dither: float = 0.0

    def __post_init__(self) -> None:
        for name in ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length"):
            check_int(getattr(self, name), name)
        if not math.isfinite(self.padding_value) or not math.isfinite(self.dither) or self.dither < 0:
            raise ValueError(f"padding_value and dither must be finite (dither >= 0), got {self.padding_value}, "
                             f"{self.dither}")

    @property
    def min_samples(self) -> int:
        """Shorter clips have no feature frame to encode."""
        return 2 * self.hop_length


@dataclass(frozen=True)
class MediaSettings:
    image: ImageSettings = field(default_factory=ImageSettings)
    audio: AudioSettings = field(default_factory=AudioSettings)
    source: str = "defaults"  # where they came from: the file's path, or "defaults"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str) -> MediaSettings:
        """The settings a ``preprocessor_config.json`` dict names; the defaults for keys it lacks."""
        try:
            return cls(image=ImageSettings(**_image_kwargs(d)), audio=AudioSettings(**_picked(d, AudioSettings)),
                       source=source)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from e

    @classmethod
    def from_checkpoint(cls, model_path: str | Path | None) -> MediaSettings:
        """The checkpoint directory's ``preprocessor_config.json``, or the defaults where it has none
        (or there is no checkpoint: the tiny model)."""
        if model_path is None:
            return cls()
        path = Path(model_path) / PREPROCESSOR_FILE
        if not path.is_file():
            return cls()
        try:
            d = read_json(path, PREPROCESSOR_FILE)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        return cls.from_dict(d, str(path))

    def check_against(self, vision: Mapping[str, Any], audio: Mapping[str, Any]) -> None:
        """Refuse settings that do not fit the towers (``thinker_config.vision_config`` /
        ``audio_config`` of config.json; a key the config lacks is not checked)."""
        pairs = [("patch_size", self.image.patch_size, vision.get("patch_size")),
                 ("temporal_patch_size", self.image.temporal_patch_size, vision.get("temporal_patch_size")),
                 ("merge_size", self.image.merge_size, vision.get("spatial_merge_size")),
                 ("feature_size", self.audio.feature_size, audio.get("num_mel_bins"))]
        bad = [f"{name} {ours} (the towers' config: {theirs})" for name, ours, theirs in pairs
               if theirs is not None and int(theirs) != ours]
        if bad:
            raise CheckpointError(f"{self.source}: preprocessing does not fit the model: {', '.join(bad)}")


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


_FLOAT_FIELDS = frozenset({"padding_value", "dither"})  # numbers a file may write as ints


def _picked(d: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """The keys of ``d`` that are fields of ``cls`` and set."""
    names = {f.name for f in fields(cls)} & {k for k, v in d.items() if v is not None}
    return {k: _number(d[k], k) if k in _FLOAT_FIELDS else d[k] for k in names}


def _image_kwargs(d: Mapping[str, Any]) -> dict[str, Any]:
    """ImageSettings' fields from the file: ``size``'s edges first, ``min_pixels`` / ``max_pixels`` over them."""
    out = _picked(d, ImageSettings)
    for name in ("image_mean", "image_std"):
        if name in out:
            value = out[name]
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = [value] * 3
            if not isinstance(value, list | tuple):
                raise ValueError(f"{name} must be a list of three numbers, got {value!r}")
            out[name] = tuple(_number(v, name) for v in value)
    size = d.get("size")
    if isinstance(size, Mapping):
        for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if size.get(key) is not None and name not in out:
                out[name] = size[key]
    elif size is not None:
        raise ValueError(f"size must be an object with shortest_edge / longest_edge, got {size!r}")
    return out
