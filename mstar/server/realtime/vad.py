"""Server voice activity detection: the Silero VAD model (PyPI ``silero-vad``, which ships its weights)
over a session's appended audio, with the Realtime API's ``threshold``, ``prefix_padding_ms`` and
``silence_duration_ms``.

The TorchScript model is loaded from the installed package's data folder without importing the
package: its ``__init__`` calls ``torch.set_num_threads(1)`` for the whole process. Each session
gets its own model instance (the model keeps its recurrent state between windows). Input is 24 kHz
PCM16; it is averaged three samples at a time down to 8 kHz (a cheap low-pass that is exact across
append boundaries), which the model reads in windows of 256 samples (32 ms).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path

import torch

from mstar.server.realtime.events import INPUT_RATE, VadConfig

__all__ = ["VadEvent", "VadKind", "VadStream", "vad_available"]

_RATE = 8000
_DECIMATE = INPUT_RATE // _RATE
_WINDOW = 256  # samples per model call at 8 kHz
_WINDOW_MS = _WINDOW * 1000 // _RATE
_HYSTERESIS = 0.15  # speech ends below threshold - this (the package's own VADIterator rule)


class VadKind(Enum):
    STARTED = "speech_started"
    STOPPED = "speech_stopped"


@dataclass(frozen=True)
class VadEvent:
    kind: VadKind
    at_ms: int  # in the input buffer's time: the start (less the prefix padding) or the end of speech


def _model_file() -> Path | None:
    spec = importlib.util.find_spec("silero_vad")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"
    return path if path.is_file() else None


@cache
def _model_bytes() -> bytes:
    path = _model_file()
    if path is None:
        raise RuntimeError("server_vad needs the silero-vad package (pip install silero-vad)")
    return path.read_bytes()


def vad_available() -> bool:
    return _model_file() is not None


def _load_model() -> torch.jit.ScriptModule:
    import io

    model = torch.jit.load(io.BytesIO(_model_bytes()), map_location="cpu")
    model.eval()
    return model


class VadStream:
    """Speech start / stop events of one session's input audio, fed as it is appended."""

    def __init__(self, config: VadConfig) -> None:
        self.config = config
        self.model = _load_model()
        self.reset()

    def reset(self) -> None:
        """A new buffer (cleared or committed): times start from 0 again, no speech under way."""
        self.model.reset_states()
        self._rest = torch.zeros(0, dtype=torch.float32)  # 24 kHz samples not yet averaged
        self._low = torch.zeros(0, dtype=torch.float32)  # 8 kHz samples not yet in a window
        self._windows = 0
        self.speaking = False
        self._silent_ms = 0

    def feed(self, pcm: torch.Tensor) -> list[VadEvent]:
        """``pcm``: int16 samples at 24 kHz, appended after the previous call's."""
        x = torch.cat([self._rest, pcm.to(torch.float32) / 32768.0])
        usable = x.numel() // _DECIMATE * _DECIMATE
        self._rest = x[usable:]
        low = torch.cat([self._low, x[:usable].view(-1, _DECIMATE).mean(1)])
        events: list[VadEvent] = []
        n = low.numel() // _WINDOW
        with torch.inference_mode():
            for i in range(n):
                prob = float(self.model(low[i * _WINDOW:(i + 1) * _WINDOW].unsqueeze(0), _RATE))
                event = self._step(prob)
                if event is not None:
                    events.append(event)
                self._windows += 1
        self._low = low[n * _WINDOW:]
        return events

    def _step(self, prob: float) -> VadEvent | None:
        c, start_ms = self.config, self._windows * _WINDOW_MS
        if not self.speaking:
            if prob >= c.threshold:
                self.speaking, self._silent_ms = True, 0
                return VadEvent(VadKind.STARTED, max(0, start_ms - c.prefix_padding_ms))
            return None
        if prob >= c.threshold:
            self._silent_ms = 0
        elif prob < c.threshold - _HYSTERESIS:
            self._silent_ms += _WINDOW_MS
            if self._silent_ms >= max(c.silence_duration_ms, _WINDOW_MS):
                self.speaking = False
                return VadEvent(VadKind.STOPPED, start_ms + _WINDOW_MS)
        return None
