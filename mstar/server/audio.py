"""Speech output formats behind one interface: an ``AudioEncoder`` is fed int16 mono PCM chunks and
returns the bytes of its format as soon as they are final, so a streamable format goes out while the
model still speaks.

* ``wav``, ``pcm``: written here; a streamed WAV has a header of unknown length.
* ``flac``: ``soundfile`` (libsndfile), whole files only: its header is rewritten at the end.
* ``mp3``, ``opus`` (Ogg), ``aac`` (ADTS): PyAV (FFmpeg), muxed into a write-only sink, so no muxer
  ever seeks back to rewrite a header and every byte can be streamed.

The codec packages are imported when a request first asks for their format; a missing one is a 400
naming the package. A reply without samples is a bare WAV header, an empty PCM body, or, in the
compressed formats (which have no valid empty file), one codec frame of silence.
"""

from __future__ import annotations

import io
import struct

import numpy as np

MIME = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
        "opus": "audio/ogg", "aac": "audio/aac"}
STREAMABLE = frozenset({"wav", "pcm", "mp3", "opus", "aac"})

# format -> (FFmpeg muxer, encoder, bit rate); 24 kHz mono speech
_AV_FORMATS = {"mp3": ("mp3", "libmp3lame", 64_000), "opus": ("ogg", "libopus", 48_000),
               "aac": ("adts", "aac", 64_000)}
_OGG_PAGE_US = "20000"  # flush an Ogg page every 20 ms of audio instead of every second


class AudioEncoder:
    """``feed`` each chunk, then ``finish`` once; every call returns the bytes that are ready."""

    mime: str

    def feed(self, pcm: np.ndarray) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        return b""


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; unknown length (streaming) uses 0xFFFFFFFF sizes."""
    data = 0xFFFFFFFF if num_samples is None else num_samples * 2
    riff = 0xFFFFFFFF if num_samples is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", data))


class _Pcm(AudioEncoder):
    mime = MIME["pcm"]

    def feed(self, pcm):
        return pcm.astype("<i2").tobytes()


class _Wav(_Pcm):
    """The header goes out with the first bytes: sized when the length is known, open-ended if not."""

    mime = MIME["wav"]

    def __init__(self, rate: int, num_samples: int | None) -> None:
        self.header: bytes | None = wav_header(rate, num_samples)

    def feed(self, pcm):
        head, self.header = self.header or b"", None
        return head + super().feed(pcm)

    def finish(self):
        return self.feed(np.zeros(0, np.int16)) if self.header else b""


class _Flac(AudioEncoder):
    mime = MIME["flac"]

    def __init__(self, rate: int) -> None:
        self.soundfile = _require("soundfile", "soundfile", "flac")
        self.rate, self.chunks = rate, []

    def feed(self, pcm):
        self.chunks.append(pcm)
        return b""

    def finish(self):
        buf = io.BytesIO()
        pcm = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        if pcm.size == 0:
            pcm = np.zeros(1, np.int16)  # FLAC has no empty file: one sample of silence keeps it valid
        self.soundfile.write(buf, pcm, self.rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()


class _Sink:
    """A write-only file for PyAV: with no ``seek`` the muxer writes straight through."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class _Av(AudioEncoder):
    def __init__(self, fmt: str, rate: int) -> None:
        self.av = _require("av", "av (PyAV)", fmt)
        muxer, codec, bit_rate = _AV_FORMATS[fmt]
        self.mime, self.rate, self.pts = MIME[fmt], rate, 0
        self.sink = _Sink()
        options = {"page_duration": _OGG_PAGE_US} if muxer == "ogg" else {}
        self.out = self.av.open(self.sink, mode="w", format=muxer, options=options)
        self.stream = self.out.add_stream(codec, rate=rate, layout="mono")
        self.stream.bit_rate = bit_rate

    def feed(self, pcm):
        if pcm.size == 0:
            return b""
        frame = self.av.AudioFrame.from_ndarray(pcm.astype(np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = self.rate, self.pts
        self.pts += pcm.size
        return self._mux(frame)

    def finish(self):
        # no decodable empty mp3 / Ogg / ADTS file exists: a reply without samples gets one frame of silence
        head = self.feed(np.zeros(1, np.int16)) if self.pts == 0 else b""
        tail = self._mux(None)  # flush the encoder
        self.out.close()
        return head + tail + self.sink.take()

    def _mux(self, frame) -> bytes:
        for packet in self.stream.encode(frame):
            self.out.mux(packet)
        return self.sink.take()


def _require(module: str, package: str, fmt: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"response_format {fmt!r} needs the {package} package; use wav or pcm") from e


def new_encoder(fmt: str, rate: int, num_samples: int | None = None) -> AudioEncoder:
    """An encoder for ``fmt`` (a key of ``MIME``); ``num_samples``, when known, sizes a WAV header.
    ``ValueError`` for an unknown format or a missing codec package."""
    if fmt == "wav":
        return _Wav(rate, num_samples)
    if fmt == "pcm":
        return _Pcm()
    if fmt == "flac":
        return _Flac(rate)
    if fmt in _AV_FORMATS:
        return _Av(fmt, rate)
    raise ValueError(f"response_format {fmt!r} is not supported; use one of {', '.join(MIME)}")


def encode(pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    """A whole file of ``fmt``."""
    enc = new_encoder(fmt, rate, pcm.size)
    return enc.feed(pcm) + enc.finish()


def check_available(fmt: str) -> None:
    """``ValueError`` now, before a request starts, when ``fmt``'s codec package is missing."""
    if fmt == "flac":
        _require("soundfile", "soundfile", fmt)
    elif fmt in _AV_FORMATS:
        _require("av", "av (PyAV)", fmt)
    elif fmt not in MIME:
        raise ValueError(f"response_format {fmt!r} is not supported; use one of {', '.join(MIME)}")
