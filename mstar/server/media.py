"""Decoding and encoding media for the API: base64, data URLs, images, WAV audio, tensors.

Every decoder is bounded (pixels, samples, elements) before it decodes, and raises ``ValueError``
(HTTP 400) for anything it cannot decode."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
import wave

import numpy as np
import torch

from mstar.server import audio


def b64decode(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what}: invalid base64 ({e})") from e


def decode_data_url(url: str, what: str) -> tuple[str, bytes]:
    if not url.startswith("data:") or "," not in url:
        raise ValueError(f"{what}: only data URLs (data:<mime>;base64,...) are accepted; remote URLs are not fetched")
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise ValueError(f"{what}: data URL must be base64-encoded")
    return head[5:-7], b64decode(payload, what)


_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # the decoders a client can reach


def decode_image(data: bytes, what: str, max_pixels: int, max_side: int = 16384) -> torch.Tensor:
    """uint8 [H, W, 3]. The size in the header is checked before any pixel is decoded, so a small
    file declaring a huge image (a decompression bomb) costs nothing; every decode error is a ValueError."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # Pillow warns above its own limit; ours is lower and checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=_IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise ValueError(f"{what}: image exceeds the limit of {max_pixels} pixels") from e
    except Exception as e:  # noqa: BLE001 - whatever a malformed file makes a decoder raise is the client's
        raise ValueError(f"{what}: cannot decode image (not a {', '.join(_IMAGE_FORMATS)} image)") from e
    w, h = img.size
    if w * h > max_pixels or max(w, h) > max_side:
        raise ValueError(f"{what}: image of {w}x{h} exceeds the limit of {max_pixels} pixels "
                         f"({max_side} per side)")
    if w == 0 or h == 0:
        raise ValueError(f"{what}: image of {w}x{h} is empty")
    try:
        arr = np.asarray(img.convert("RGB"))
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ValueError(f"{what}: cannot decode image ({type(e).__name__}: {e})") from e
    return torch.from_numpy(arr.copy())


def encode_png(pixels: torch.Tensor) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).cpu().numpy()).save(buf, format="PNG")
    return buf.getvalue()


MAX_SAMPLE_RATE = 384_000


def decode_wav(data: bytes, what: str, max_samples: int = 24000 * 600) -> tuple[torch.Tensor, int]:
    """Mono int16 PCM samples and the sample rate (channels are averaged). The header is checked
    (rate, channels, sample width) and at most ``max_samples`` frames are read; longer audio is a
    ValueError, as is every decode error."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            rate, ch, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
            if width != 2:
                raise ValueError(f"{what}: only 16-bit PCM WAV is supported")
            if not 1 <= rate <= MAX_SAMPLE_RATE:
                raise ValueError(f"{what}: sample rate {rate} is not in [1, {MAX_SAMPLE_RATE}]")
            raw = w.readframes(max_samples + 1)  # the header's length may lie: read at most one frame more
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - wave.Error, EOFError, struct.error ... on a malformed file
        raise ValueError(f"{what}: cannot decode WAV audio ({e})") from e
    pcm = np.frombuffer(raw[:len(raw) - len(raw) % (2 * ch)], dtype="<i2")
    if pcm.size > max_samples * ch:
        raise ValueError(f"{what}: audio exceeds the limit of {max_samples} samples")
    if ch > 1:
        pcm = pcm.reshape(-1, ch).mean(axis=1).astype(np.int16)
    return torch.from_numpy(pcm.copy()), rate


def pcm_bytes(pcm: torch.Tensor) -> bytes:
    return pcm.to(torch.int16).cpu().numpy().astype("<i2").tobytes()


def encode_audio(pcm: torch.Tensor, sample_rate: int, fmt: str) -> tuple[bytes, str]:
    """A whole file of ``fmt`` (see ``mstar.server.audio``) and its MIME type."""
    return audio.encode(pcm.to(torch.int16).cpu().numpy(), sample_rate, fmt), audio.MIME[fmt]


def tensor_to_json(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().tobytes()
    else:
        raw = t.numpy().tobytes()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw).decode()}


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
           "uint8": torch.uint8, "bool": torch.bool}


def tensor_from_json(obj, what: str, max_elements: int = 1 << 26, max_dims: int = 8) -> torch.Tensor:
    """A tensor from {"dtype", "shape", "data": base64} or from (nested) JSON numbers. The shape is
    checked (at most ``max_dims`` dims, ``max_elements`` elements) before anything is allocated."""
    if isinstance(obj, dict):
        t = _tensor_from_object(obj, what, max_elements, max_dims)
    else:
        t = _tensor_from_list(obj, what)
    if t.dim() > max_dims or t.numel() > max_elements:
        raise ValueError(f"{what}: tensor of shape {list(t.shape)} exceeds {max_dims} dims or {max_elements} elements")
    return t


def _tensor_from_object(obj: dict, what: str, max_elements: int, max_dims: int) -> torch.Tensor:
    dtype_name, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES or not isinstance(data, str) \
            or not isinstance(shape, list):
        raise ValueError(f"{what}: tensor objects need dtype (one of {sorted(_DTYPES)}), shape (a list) and data")
    if len(shape) > max_dims or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"{what}: shape must be a list of at most {max_dims} ints >= 0, got {shape}")
    n = 1
    for s in shape:  # Python ints: no overflow, whatever the client sends
        n *= s
    if n > max_elements:
        raise ValueError(f"{what}: shape {shape} has {n} elements; the limit is {max_elements}")
    dtype = _DTYPES[dtype_name]
    raw = b64decode(data, what)
    store = torch.int16 if dtype == torch.bfloat16 else dtype
    itemsize = torch.empty(0, dtype=store).element_size()
    if len(raw) != n * itemsize:
        raise ValueError(f"{what}: data has {len(raw)} bytes, shape {shape} of {dtype_name} needs {n * itemsize}")
    t = torch.frombuffer(bytearray(raw), dtype=store) if raw else torch.empty(0, dtype=store)
    t = t.reshape(shape)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _tensor_from_list(obj, what: str) -> torch.Tensor:
    if not isinstance(obj, (list, int, float)):  # a bool is an int: a 0-dim bool tensor
        raise ValueError(f"{what}: not a tensor: expected numbers, nested lists or {{dtype, shape, data}}")
    try:
        return torch.tensor(obj)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"{what}: not a tensor: expected numbers, nested lists or {{dtype, shape, data}}") from e
