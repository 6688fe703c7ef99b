"""pi0.5 input processing as the reference does it (lerobot 0.6.1's pi05 processors, openpi's
``PaligemmaTokenizer``): camera images resized with padding into [-1, 1], missing cameras masked,
the state quantile-normalised and discretised into 256 bins inside the prompt text, the prompt
encoded with BOS, and actions un-normalised with the checkpoint's statistics.

Everything here is a pure function of its arguments (or a frozen dataclass), so the HTTP adapter,
the websocket policy server and the tests share one implementation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CAMERA_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")  # the model's camera order
STATE_BINS = 256
MAX_PROMPT_TOKENS = 200  # lerobot's tokenizer_max_length for pi0.5
BOS_ID = 2
TOKENIZER_FILES = ("paligemma_tokenizer.model", "tokenizer.model")


# -- images ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """One robot observation as a client sends it (cameras by slot name, the state unnormalised)."""

    cameras: Mapping[str, torch.Tensor]
    state: np.ndarray | None = None
    prompt: str | None = None
    token_ids: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    seed: int | None = None
    action_dim: int | None = None


def resize_with_pad(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """An ``[H, W, 3]`` image (uint8, or float in [0, 1]) scaled to fit ``height x width`` keeping its
    aspect ratio (bilinear, ``align_corners=False``), centred, the rest black; same dtype out.

    The reference's arithmetic: ratio ``max(W/width, H/height)``, sizes truncated (``int``), uint8
    rounded back, the odd padding pixel at the bottom / right."""
    h, w = image.shape[0], image.shape[1]
    if (h, w) == (height, width):
        return image
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    # uint8 stays uint8 through the interpolation: torch's uint8 kernel rounds as the reference's does
    x = image.permute(2, 0, 1).unsqueeze(0)
    x = x if x.dtype == torch.uint8 else x.to(torch.float32)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False)
    x = x if x.dtype == torch.uint8 else x.clamp(0.0, 1.0)
    top, left = (height - rh) // 2, (width - rw) // 2
    x = F.pad(x, (left, width - rw - left, top, height - rh - top), value=0)
    return x[0].permute(1, 2, 0)


def check_image(image: torch.Tensor, what: str) -> None:
    """A camera image is ``[H, W, 3]`` uint8, or float in [0, 1] (no NaN)."""
    if image.dim() != 3 or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"{what}: expected an [H, W, 3] image, got shape {list(image.shape)}")
    if image.dtype == torch.uint8:
        return
    if not image.is_floating_point():
        raise ValueError(f"{what}: expected uint8 or float pixels, got {image.dtype}")
    if not bool(torch.isfinite(image).all()) or float(image.min()) < 0.0 or float(image.max()) > 1.0:
        raise ValueError(f"{what}: float pixels must be finite and in [0, 1]")


def image_to_model(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """One camera image -> ``[3, height, width]`` float32 in [-1, 1] (uint8 ``/255``, then ``*2-1``)."""
    x = resize_with_pad(image, height, width)
    x = x.to(torch.float32) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float32)
    return (x * 2.0 - 1.0).permute(2, 0, 1).contiguous()


@dataclass(frozen=True)
class CameraImages:
    """Every camera slot in model order: ``images [num_cameras, 3, H, W]`` in [-1, 1] (a missing
    camera is all -1) and ``mask [num_cameras]`` (False: missing, its tokens are ignored)."""

    images: torch.Tensor
    mask: torch.Tensor


def prepare_cameras(cameras: Mapping[str, torch.Tensor], height: int, width: int,
                    slots: Sequence[str] = CAMERA_SLOTS) -> CameraImages:
    """Images by slot name -> ``CameraImages``; at least one slot must be given, unknown names are refused."""
    unknown = sorted(set(cameras) - set(slots))
    if unknown:
        raise ValueError(f"unknown camera(s) {unknown}; the cameras are {list(slots)}")
    if not cameras:
        raise ValueError(f"at least one camera image is required (cameras: {list(slots)})")
    images, mask = [], []
    for slot in slots:
        if slot in cameras:
            check_image(cameras[slot], f"image {slot!r}")
            images.append(image_to_model(cameras[slot], height, width))
        else:
            images.append(torch.full((3, height, width), -1.0))
        mask.append(slot in cameras)
    return CameraImages(torch.stack(images), torch.tensor(mask, dtype=torch.bool))


# -- state and prompt ------------------------------------------------------------------------------


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Normalised state -> bin indices: ``np.digitize`` on 256 equal bins of [-1, 1], minus one.
    Not clipped, as in the reference: below -1 gives -1, from ``1 - 1/128`` up gives 255."""
    edges = np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]
    return np.digitize(np.asarray(state), bins=edges) - 1


def clean_task(task: str) -> str:
    """The reference's cleaning: stripped, underscores and newlines to spaces; case kept."""
    return task.strip().replace("_", " ").replace("\n", " ")


def state_prompt(task: str, state_norm: np.ndarray) -> str:
    """``Task: <task>, State: <bins>;\\nAction: `` with the state at the robot's own dimension."""
    bins = " ".join(str(int(b)) for b in discretize_state(state_norm).reshape(-1))
    return f"Task: {clean_task(task)}, State: {bins};\nAction: "


def check_state(state: np.ndarray, what: str = "state") -> np.ndarray:
    """A 1-D vector of finite numbers, as float32."""
    arr = np.asarray(state)
    if arr.dtype.kind not in "fiu" or arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what}: expected a non-empty 1-D numeric vector, got shape {list(arr.shape)} "
                         f"dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise ValueError(f"{what}: must be finite (got NaN or inf)")
    return arr


@dataclass(frozen=True)
class PromptTokens:
    """Token ids of the prefix text and their mask (True: a real token)."""

    ids: torch.Tensor  # int64 [L]
    mask: torch.Tensor  # bool [L]


def prompt_tokens(ids: Sequence[int] | torch.Tensor, vocab_size: int,
                  max_tokens: int = MAX_PROMPT_TOKENS) -> PromptTokens:
    """Ids given directly (or encoded) -> ``PromptTokens``, truncated to ``max_tokens`` as the
    reference does; every id must be in ``[0, vocab_size)``. No padding: masked padding changes
    nothing, so only real tokens are passed on."""
    t = torch.as_tensor(ids)
    if t.dim() != 1 or t.numel() == 0 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"token ids: expected a non-empty 1-D integer list, got shape {list(t.shape)} "
                         f"dtype {t.dtype}")
    t = t.to(torch.int64)[:max_tokens]
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(t.min())}..{int(t.max())}")
    return PromptTokens(t, torch.ones(t.numel(), dtype=torch.bool))


class PromptTokenizer:
    """The checkpoint's SentencePiece model (``paligemma_tokenizer.model`` or ``tokenizer.model``),
    loaded on first use and never pickled; ``encode`` puts BOS first, as the reference does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sp = None

    @classmethod
    def find(cls, directory: str | Path | None) -> PromptTokenizer | None:
        if directory is None:
            return None
        for name in TOKENIZER_FILES:
            if (Path(directory) / name).is_file():
                return cls(Path(directory) / name)
        return None

    def encode(self, text: str) -> list[int]:
        if self._sp is None:
            import sentencepiece

            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        return [BOS_ID, *self._sp.encode(text)]

    def __getstate__(self):
        return {"path": self.path, "_sp": None}


# -- normalisation statistics ----------------------------------------------------------------------


@dataclass(frozen=True)
class QuantileStats:
    """Quantile normalisation to [-1, 1] with the 1st and 99th percentiles; dimensions beyond the
    statistics pass through unchanged. ``openpi_eps``: openpi adds 1e-6 to every denominator;
    lerobot (the default) replaces only a zero denominator by 1e-8."""

    q01: np.ndarray
    q99: np.ndarray
    openpi_eps: bool = False

    def __post_init__(self) -> None:
        q01, q99 = np.asarray(self.q01, np.float32).reshape(-1), np.asarray(self.q99, np.float32).reshape(-1)
        if q01.shape != q99.shape or q01.size == 0 or not (np.isfinite(q01).all() and np.isfinite(q99).all()):
            raise ValueError(f"quantile stats: q01 {list(q01.shape)} and q99 {list(q99.shape)} must be finite "
                             f"vectors of one length")
        object.__setattr__(self, "q01", q01)
        object.__setattr__(self, "q99", q99)

    def _denom(self) -> np.ndarray:
        d = self.q99 - self.q01
        return d + np.float32(1e-6) if self.openpi_eps else np.where(d == 0, np.float32(1e-8), d)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        out = np.array(x, dtype=np.float32, copy=True)
        n = min(out.shape[-1], self.q01.size)
        out[..., :n] = 2.0 * (out[..., :n] - self.q01[:n]) / self._denom()[:n] - 1.0
        return out

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        out = np.array(x, dtype=np.float32, copy=True)
        n = min(out.shape[-1], self.q01.size)
        out[..., :n] = (out[..., :n] + 1.0) * self._denom()[:n] / 2.0 + self.q01[:n]
        return out


@dataclass(frozen=True)
class NormStats:
    """The checkpoint's statistics for the state (inputs) and the actions (outputs); either may be absent."""

    state: QuantileStats | None = None
    actions: QuantileStats | None = None


def load_norm_stats(directory: str | Path | None) -> NormStats:
    """Statistics from a checkpoint directory: lerobot's ``*normalizer_processor.safetensors`` files
    (``observation.state.q01``, ``action.q99``, ...) or openpi's ``norm_stats.json`` (at the top or
    under ``assets/<asset_id>/``); ``NormStats()`` when there are none."""
    if directory is None:
        return NormStats()
    root = Path(directory)
    lerobot = sorted(root.glob("*normalizer_processor.safetensors"))
    if lerobot:
        return _lerobot_stats(lerobot)
    openpi = [root / "norm_stats.json", *sorted(root.glob("assets/*/norm_stats.json"))]
    for path in openpi:
        if path.is_file():
            return _openpi_stats(path)
    return NormStats()


def _lerobot_stats(paths: list[Path]) -> NormStats:
    from safetensors.numpy import load_file

    flat: dict[str, np.ndarray] = {}
    for p in paths:  # the pre- and post-processor files hold the same features
        flat.update(load_file(str(p)))

    def quantiles(feature: str) -> QuantileStats | None:
        lo, hi = flat.get(f"{feature}.q01"), flat.get(f"{feature}.q99")
        return None if lo is None or hi is None else QuantileStats(lo, hi)

    return NormStats(state=quantiles("observation.state"), actions=quantiles("action"))


def _openpi_stats(path: Path) -> NormStats:
    try:
        stats = json.loads(path.read_text())["norm_stats"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an openpi norm_stats.json ({e})") from e

    def quantiles(key: str) -> QuantileStats | None:
        s = stats.get(key)
        return None if s is None else QuantileStats(np.asarray(s["q01"]), np.asarray(s["q99"]), openpi_eps=True)

    return NormStats(state=quantiles("state"), actions=quantiles("actions"))


def normalized_state(state: np.ndarray, stats: NormStats) -> np.ndarray:
    """The state as the prompt sees it: quantile-normalised when the checkpoint has state
    statistics, else taken as already normalised."""
    return state if stats.state is None else stats.state.normalize(state)

