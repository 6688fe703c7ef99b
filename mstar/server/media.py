"""Decoding and encoding media for the API: base64, data URLs, images (PNG/JPEG), WAV audio."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import wave

import numpy as np
import torch


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


def decode_image(data: bytes, what: str, max_pixels: int) -> torch.Tensor:
    """uint8 [H, W, 3]."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:
            raise ValueError(f"{what}: image of {img.width}x{img.height} exceeds the limit of {max_pixels} pixels")
        arr = np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{what}: cannot decode image ({e})") from e
    return torch.from_numpy(arr.copy())


def encode_png(pixels: torch.Tensor) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).cpu().numpy()).save(buf, format="PNG")
    return buf.getvalue()


def decode_wav(data: bytes, what: str) -> tuple[torch.Tensor, int]:
    """Mono int16 PCM samples and the sample rate (stereo is averaged)."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"{what}: only 16-bit PCM WAV is supported")
            rate, ch = w.getframerate(), w.getnchannels()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    except (wave.Error, EOFError) as e:
        raise ValueError(f"{what}: cannot decode WAV audio ({e})") from e
    if ch > 1:
        pcm = pcm.reshape(-1, ch).mean(axis=1).astype(np.int16)
    return torch.from_numpy(pcm.copy()), rate


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; unknown length (streaming) uses 0xFFFFFFFF sizes."""
    data = 0xFFFFFFFF if num_samples is None else num_samples * 2
    riff = 0xFFFFFFFF if num_samples is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", data))


def pcm_bytes(pcm: torch.Tensor) -> bytes:
    return pcm.to(torch.int16).cpu().numpy().astype("<i2").tobytes()


def encode_audio(pcm: torch.Tensor, sample_rate: int, fmt: str) -> tuple[bytes, str]:
    """Whole-file encoding: wav, pcm (raw s16le) or flac (needs soundfile)."""
    raw = pcm_bytes(pcm)
    if fmt == "wav":
        return wav_header(sample_rate, len(raw) // 2) + raw, "audio/wav"
    if fmt == "pcm":
        return raw, "audio/pcm"
    if fmt == "flac":
        try:
            import soundfile
        except ImportError as e:
            raise ValueError("response_format 'flac' needs the soundfile package; use wav or pcm") from e
        buf = io.BytesIO()
        soundfile.write(buf, pcm.cpu().numpy(), sample_rate, format="FLAC")
        return buf.getvalue(), "audio/flac"
    raise ValueError(f"response_format {fmt!r} is not supported; use wav, pcm or flac")


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


def tensor_from_json(obj, what: str) -> torch.Tensor:
    """A tensor from {"dtype", "shape", "data": base64} or from (nested) JSON numbers."""
    if isinstance(obj, dict):
        try:
            dtype = _DTYPES[obj["dtype"]]
            shape = [int(x) for x in obj["shape"]]
            raw = b64decode(obj["data"], what)
        except KeyError as e:
            raise ValueError(f"{what}: tensor objects need dtype (one of {sorted(_DTYPES)}), shape and data") from e
        if any(s < 0 for s in shape):
            raise ValueError(f"{what}: negative dimension in shape {shape}")
        store = torch.int16 if dtype == torch.bfloat16 else dtype
        itemsize = torch.empty(0, dtype=store).element_size()
        n = int(np.prod(shape)) if shape else 1
        if len(raw) != n * itemsize:
            raise ValueError(f"{what}: data has {len(raw)} bytes, shape {shape} of {obj['dtype']} needs {n * itemsize}")
        t = torch.frombuffer(bytearray(raw), dtype=store) if raw else torch.empty(0, dtype=store)
        t = t.reshape(shape)
        return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    try:
        return torch.tensor(obj)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{what}: not a tensor: expected numbers, nested lists or {{dtype, shape, data}}") from e
