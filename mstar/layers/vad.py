"""Voice activity detection as a graph node: the Silero VAD model (PyPI ``silero-vad``, which ships its
weights) over 8 kHz audio windows, its recurrent state carried by the request.

A family whose requests may be spoken (Qwen3-Omni) adds ``vad_walk()`` to a partition of its graph,
``SileroVadNode`` to its submodules and ``VadRequest`` to its request types; its API adapter makes
the requests (``ApiAdapter.vad_request``). The realtime route sends one per stretch of a session's
appended audio:

* inputs ``vad_audio`` (``[n * 256]`` float samples at 8 kHz: whole 32 ms windows), ``vad_state``
  (``[2, 128]``, the network's recurrent state) and ``vad_context`` (``[32]``, the samples before the
  first window);
* emitted ``vad_probs`` (``[n]``, the speech probability of each window), and ``vad_state`` and
  ``vad_context`` to send with the next stretch.

The node batches a step's requests window by window: one call of the 8 kHz network for all the
requests that still have a window at that index. Its rows are independent, so a stretch's
probabilities do not depend on the batch it joined (within float rounding of the batched matmuls).

The TorchScript file is read from the installed package's data folder without importing the package:
its ``__init__`` calls ``torch.set_num_threads(1)`` for the whole process.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from mstar.graph import EMIT_TO_CLIENT, GraphEdge, GraphNode, Walk
from mstar.model.request import ModelRequest
from mstar.model.sendable import register_message
from mstar.model.submodule import EngineInputs, ForwardInfo, NodeInputs, NodeSubmodule

__all__ = ["MAX_VAD_WINDOWS", "VAD_CONTEXT", "VAD_INPUTS", "VAD_NODE", "VAD_RATE", "VAD_STATE_SHAPE", "VAD_WALK",
           "VAD_WINDOW", "SileroVadNode", "VadRequest", "check_vad_inputs", "initial_vad_state", "load_silero",
           "vad_available", "vad_walk"]

VAD_RATE = 8000
VAD_WINDOW = 256  # samples per network call at 8 kHz (32 ms)
VAD_CONTEXT = 32  # samples of the previous window each call also reads
VAD_STATE_SHAPE = (2, 128)
VAD_NODE, VAD_WALK = "vad", "vad"
VAD_INPUTS = ("vad_audio", "vad_state", "vad_context")
MAX_VAD_WINDOWS = 60 * VAD_RATE // VAD_WINDOW  # a minute of audio per request at most


def check_vad_inputs(audio: Any, state: Any, context: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A VAD request's inputs as ``[n, 256]`` windows, ``[2, 128]`` state and ``[32]`` context, all
    float; ValueError naming what is wrong."""
    tensors = (audio, state, context)
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        raise ValueError(f"{', '.join(VAD_INPUTS)} must be float tensors")
    audio = audio.reshape(-1).float()
    if audio.numel() == 0 or audio.numel() % VAD_WINDOW or audio.numel() > MAX_VAD_WINDOWS * VAD_WINDOW:
        raise ValueError(f"vad_audio must hold 1 to {MAX_VAD_WINDOWS} whole windows of {VAD_WINDOW} samples at "
                         f"{VAD_RATE} Hz, got {audio.numel()} samples")
    if tuple(state.shape) != VAD_STATE_SHAPE or context.numel() != VAD_CONTEXT:
        raise ValueError(f"vad_state must be {list(VAD_STATE_SHAPE)} and vad_context [{VAD_CONTEXT}]")
    return audio.view(-1, VAD_WINDOW), state.float(), context.reshape(-1).float()


@register_message
@dataclass(frozen=True)
class VadRequest(ModelRequest):
    """A stretch of audio for the VAD walk (no KV, no sampling: the inputs say it all)."""


def vad_walk(partition: str) -> Walk:
    """The one-node walk: the inputs -> ``SileroVadNode`` -> its three outputs to the client."""
    node = GraphNode(VAD_NODE, list(VAD_INPUTS), [GraphEdge(EMIT_TO_CLIENT, n) for n in
                                                  ("vad_probs", "vad_state", "vad_context")])
    return Walk(VAD_WALK, node, inputs=list(VAD_INPUTS), partition=partition)


def initial_vad_state() -> tuple[torch.Tensor, torch.Tensor]:
    """(``vad_state``, ``vad_context``) of a stream's start: silence before it."""
    return torch.zeros(VAD_STATE_SHAPE), torch.zeros(VAD_CONTEXT)


def _model_file() -> Path | None:
    spec = importlib.util.find_spec("silero_vad")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"
    return path if path.is_file() else None


def vad_available() -> bool:
    return _model_file() is not None


@cache
def _model_bytes() -> bytes:
    path = _model_file()
    if path is None:
        raise RuntimeError("voice activity detection needs the silero-vad package (pip install silero-vad)")
    return path.read_bytes()


def load_silero() -> torch.jit.ScriptModule:
    """The packaged TorchScript model (a fresh instance: its ``forward`` keeps a stream's state)."""
    model = torch.jit.load(io.BytesIO(_model_bytes()), map_location="cpu")
    model.eval()
    return model


@dataclass(frozen=True, slots=True)
class _Stretch:
    windows: torch.Tensor  # [n, VAD_WINDOW]
    state: torch.Tensor  # [2, 128]
    context: torch.Tensor  # [VAD_CONTEXT]


class SileroVadNode(NodeSubmodule):
    """``vad_audio``, ``vad_state``, ``vad_context`` -> ``vad_probs``, ``vad_state``, ``vad_context``
    (module docstring). The model is loaded at the first forward: a served model whose sessions
    never ask for VAD never reads it."""

    def __init__(self) -> None:
        super().__init__()
        self._net: Any = None

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        return NodeInputs(args=_Stretch(*check_vad_inputs(*(inputs[name][0] for name in VAD_INPUTS))))

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        if self._net is None:
            self._net = load_silero()._model_8k  # (context + window [B, 288], state [2, B, 128]) -> (prob, state)
        stretches: list[_Stretch] = engine_inputs.args
        counts = [s.windows.shape[0] for s in stretches]
        state = torch.stack([s.state for s in stretches], dim=1)  # [2, B, 128]
        context = torch.stack([s.context for s in stretches])  # [B, 32]
        probs = torch.zeros(len(stretches), max(counts))
        with torch.inference_mode():
            for w in range(max(counts)):
                rows = [i for i, n in enumerate(counts) if n > w]
                x = torch.cat([context[rows], torch.stack([stretches[i].windows[w] for i in rows])], dim=1)
                out, new = self._net(x, state[:, rows])
                probs[rows, w] = out.reshape(-1)
                state[:, rows] = new
                context[rows] = x[:, -VAD_CONTEXT:]
        return {"vad_probs": [probs[i, :n].clone() for i, n in enumerate(counts)],
                "vad_state": [state[:, i].clone() for i in range(len(stretches))],
                "vad_context": [context[i].clone() for i in range(len(stretches))]}
