"""Server voice activity detection: the Realtime API's ``threshold``, ``prefix_padding_ms`` and
``silence_duration_ms`` over the speech probabilities of the served model's VAD walk (the Silero VAD
model, PyPI ``silero-vad``, as a graph node: ``mstar.layers.vad``), for one session's appended audio.

``VadStream`` turns 24 kHz PCM16 into the node's windows: averaged three samples at a time down to
8 kHz (a cheap low-pass that is exact across append boundaries), 256 samples (32 ms) a window,
handed out ``min_windows`` or more at a time (one VAD request per stretch, not per append); it
carries the network's state between stretches and turns their probabilities into speech events.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from mstar.layers.vad import VAD_RATE, VAD_WINDOW, initial_vad_state, vad_available
from mstar.server.realtime.events import INPUT_RATE, VadConfig

__all__ = ["VadEvent", "VadKind", "VadStream", "vad_available"]

_DECIMATE = INPUT_RATE // VAD_RATE
_WINDOW_MS = VAD_WINDOW * 1000 // VAD_RATE
_HYSTERESIS = 0.15  # speech ends below threshold - this (the package's own VADIterator rule)
MIN_WINDOWS = 3  # windows per VAD request (96 ms): the requests a session sends stay ~10 a second


class VadKind(Enum):
    STARTED = "speech_started"
    STOPPED = "speech_stopped"


@dataclass(frozen=True)
class VadEvent:
    kind: VadKind
    at_ms: int  # in the input buffer's time: the start (less the prefix padding) or the end of speech


class VadStream:
    """Speech start / stop events of one session's input audio, fed as it is appended."""

    def __init__(self, config: VadConfig, min_windows: int = MIN_WINDOWS) -> None:
        self.config = config
        self.min_windows = min_windows
        self.reset()

    def reset(self) -> None:
        """A new buffer (cleared or committed): times start from 0 again, no speech under way."""
        self.state, self.context = initial_vad_state()
        self._rest = torch.zeros(0, dtype=torch.float32)  # 24 kHz samples not yet averaged
        self._low = torch.zeros(0, dtype=torch.float32)  # 8 kHz samples not yet sent
        self._windows = 0
        self.speaking = False
        self._silent_ms = 0

    def take(self, pcm: torch.Tensor) -> torch.Tensor | None:
        """``pcm``: int16 samples at 24 kHz, appended after the previous call's. The whole windows
        to send (``[n * 256]`` at 8 kHz) once ``min_windows`` are ready, else None."""
        x = torch.cat([self._rest, pcm.to(torch.float32) / 32768.0])
        usable = x.numel() // _DECIMATE * _DECIMATE
        self._rest = x[usable:]
        self._low = torch.cat([self._low, x[:usable].view(-1, _DECIMATE).mean(1)])
        n = self._low.numel() // VAD_WINDOW
        if n < self.min_windows:
            return None
        windows, self._low = self._low[:n * VAD_WINDOW], self._low[n * VAD_WINDOW:]
        return windows

    def decide(self, probs: torch.Tensor, state: torch.Tensor, context: torch.Tensor) -> list[VadEvent]:
        """The events of the windows ``take`` handed out, given their probabilities and the state and
        context after them (the next stretch starts from those)."""
        self.state, self.context = state, context
        events = []
        for prob in probs.tolist():
            event = self._step(prob)
            if event is not None:
                events.append(event)
            self._windows += 1
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
