"""Every ``/v1/audio/speech`` format decodes back (soundfile, PyAV) to the samples the model made:
exactly for wav, pcm and flac, within codec tolerance for mp3, opus and aac, whole or streamed."""

import base64
import io
import json
import sys

import av
import httpx
import numpy as np
import pytest
import soundfile

from mstar.server import audio
from tests.server_utils import running_server
from tests.toy_server_models import SAMPLES_PER_TOKEN, ToyChat

MODEL = "toy-chat"
RATE = 24000
TOKENS = 40  # 0.4 s of audio: long enough for the lossy codecs' frames
# Pearson correlation after alignment. The toy model speaks in steps of constant level, the hardest
# signal for Opus, whose encoder removes DC; speech scores far higher.
MIN_CORRELATION = {"mp3": 0.98, "aac": 0.97, "opus": 0.8}
LOSSLESS = ("wav", "pcm", "flac")
LOSSY = tuple(MIN_CORRELATION)


@pytest.fixture(scope="module")
def server():
    with running_server(ToyChat(), MODEL) as (url, engine):
        yield url


def speech(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "input": "formats", "voice": "alice", "max_tokens": TOKENS, **extra}
    r = httpx.post(url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def reference(server) -> np.ndarray:
    pcm = np.frombuffer(speech(server, response_format="pcm").content, dtype="<i2")
    assert pcm.size >= TOKENS // 2 * SAMPLES_PER_TOKEN  # the toy may stop early, at its EOS
    return pcm


def decode(data: bytes, fmt: str) -> np.ndarray:
    """int16 mono samples at 24 kHz."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2")
    if fmt in ("wav", "flac"):
        samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
        assert rate == RATE
        return samples
    resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)  # Opus decodes at 48 kHz
    with av.open(io.BytesIO(data)) as container:
        frames = [f for frame in container.decode(audio=0) for f in resampler.resample(frame)]
    frames += resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames])


def correlation(ref: np.ndarray, got: np.ndarray, max_lag: int = 2048) -> float:
    """The best Pearson correlation of ``ref`` with ``got`` delayed by 0..max_lag samples (encoder
    delay: 1105 samples for LAME's mp3, 1024 for AAC in ADTS, none for Opus, whose header says it)."""
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    best = -1.0
    for lag in range(0, max_lag, 1):
        seg = got[lag:lag + ref.size]
        if seg.size < ref.size:
            break
        best = max(best, float(np.corrcoef(ref, seg)[0, 1]))
    return best


def check(fmt: str, data: bytes, ref: np.ndarray) -> None:
    got = decode(data, fmt)
    if fmt in LOSSLESS:
        assert np.array_equal(got, ref)
    else:
        assert correlation(ref, got) >= MIN_CORRELATION[fmt]


@pytest.mark.parametrize("fmt", LOSSLESS + LOSSY)
def test_whole_file_decodes_to_the_same_samples(server, reference, fmt):
    r = speech(server, response_format=fmt)
    assert r.headers["content-type"] == audio.MIME[fmt]
    check(fmt, r.content, reference)


@pytest.mark.parametrize("fmt", ("wav", "pcm") + LOSSY)
def test_streamed_audio_decodes_to_the_same_samples(server, reference, fmt):
    body = {"model": MODEL, "input": "formats", "max_tokens": TOKENS, "response_format": fmt,
            "stream_format": "audio"}
    with httpx.stream("POST", server + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == audio.MIME[fmt]
        data = b"".join(r.iter_bytes())
    if fmt == "wav":  # a live WAV's header has unknown sizes; soundfile wants them, so strip it
        assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff"
        data, fmt = data[44:], "pcm"
    check(fmt, data, reference)


def test_sse_carries_encoded_chunks(server, reference):
    r = speech(server, response_format="mp3", stream_format="sse")
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e]
    assert events[-1] == {"type": "speech.audio.done"}
    deltas = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert len(deltas) > 1  # encoded as the model spoke, not at the end
    check("mp3", b"".join(deltas), reference)


def test_encoder_streams_as_it_is_fed():
    """Each format's encoder hands out bytes before ``finish`` (flac, whole-file only, holds them)."""
    t = np.arange(RATE) / RATE
    pcm = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    for fmt in sorted(audio.STREAMABLE):
        enc = audio.new_encoder(fmt, RATE)
        early = b"".join(enc.feed(c) for c in np.array_split(pcm, 10)[:5])
        assert early, fmt
        whole = early + b"".join(enc.feed(c) for c in np.array_split(pcm, 10)[5:]) + enc.finish()
        got = decode(whole[44:] if fmt == "wav" else whole, "pcm" if fmt == "wav" else fmt)
        if fmt in LOSSY:
            assert correlation(pcm, got) > 0.99, fmt
        else:
            assert np.array_equal(got, pcm), fmt


def test_missing_codec_package_is_a_400(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    r = httpx.post(server + "/v1/audio/speech", json={"model": MODEL, "input": "x", "response_format": "mp3"},
                   timeout=30)
    assert r.status_code == 400 and "av (PyAV)" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", "aac"])
def test_a_reply_without_samples_is_still_a_valid_file(fmt):
    data = audio.encode(np.zeros(0, np.int16), 24000, fmt)
    if fmt == "pcm":
        assert data == b""
        return
    if fmt in ("wav", "flac"):
        got = decode(data, fmt)
    else:  # opens and decodes (to a few samples of silence: one codec frame, less the encoder delay)
        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        got = np.concatenate(frames) if frames else np.zeros(0)
    assert got.size < 4096 and not np.any(got)
