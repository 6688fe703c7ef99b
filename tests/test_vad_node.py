"""The Silero VAD as a graph node (``mstar.layers.vad``): a batch of streams of different lengths gives
each stream the probabilities and state the packaged model's own stateful ``forward`` gives it alone;
a stream sent in stretches (its state carried) gives what it gives whole; bad inputs are refused."""

from __future__ import annotations

import math

import pytest
import torch

from mstar.layers.vad import (
    VAD_CONTEXT,
    VAD_RATE,
    VAD_WINDOW,
    SileroVadNode,
    initial_vad_state,
    load_silero,
    vad_available,
)
from mstar.model.submodule import EngineInputs, ForwardInfo

pytestmark = pytest.mark.skipif(not vad_available(), reason="the silero-vad package is not installed")


def _voice(seconds: float, f0: float, seed: int) -> torch.Tensor:
    """A voiced-sounding 8 kHz signal: harmonics of ``f0`` under a syllable-rate envelope, plus noise."""
    t = torch.arange(int(seconds * VAD_RATE)) / VAD_RATE
    wave = sum(torch.sin(2 * math.pi * f0 * k * t) / k for k in range(1, 8))
    envelope = 0.5 * (1 - torch.cos(2 * math.pi * 4 * t)).clamp(min=0)
    g = torch.Generator().manual_seed(seed)
    return (0.2 * wave * envelope + 0.01 * torch.randn(t.shape, generator=g)).float()


def _reference(audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packaged model's probabilities per window and its state after them, one stream alone."""
    model = load_silero()
    with torch.inference_mode():
        probs = torch.tensor([float(model(w[None], VAD_RATE)) for w in audio.view(-1, VAD_WINDOW)])
    return probs, model._state[:, 0].clone()


def _run(node: SileroVadNode, stretches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, list]:
    info = ForwardInfo("r", "vad", "vad", (), None)
    args = [node.prepare_inputs("vad", info, {"vad_audio": [a], "vad_state": [s], "vad_context": [c]}).args
            for a, s, c in stretches]
    n = len(args)
    return node.forward("vad", EngineInputs(["vad"] * n, ["vad"] * n, ["r"] * n, [info] * n, {}, args))


def test_a_batch_of_streams_gives_each_what_the_packaged_model_gives_it_alone():
    audio = [_voice(n * VAD_WINDOW / VAD_RATE, f0, i) for i, (n, f0) in enumerate([(9, 140), (4, 220), (1, 110)])]
    out = _run(SileroVadNode(), [(a, *initial_vad_state()) for a in audio])
    for a, probs, state, context in zip(audio, out["vad_probs"], out["vad_state"], out["vad_context"]):
        ref_probs, ref_state = _reference(a)
        assert probs.shape == ref_probs.shape
        torch.testing.assert_close(probs, ref_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)
        assert torch.equal(context, a[-VAD_CONTEXT:])
    assert float(out["vad_probs"][0].max()) > 0.5  # the voiced signal is heard as speech somewhere


def test_a_stream_in_stretches_gives_what_it_gives_whole():
    node, audio = SileroVadNode(), _voice(12 * VAD_WINDOW / VAD_RATE, 180, 3)
    whole = _run(node, [(audio, *initial_vad_state())])
    state, context = initial_vad_state()
    probs = []
    for part in audio.split(4 * VAD_WINDOW):
        out = _run(node, [(part, state, context)])
        probs.append(out["vad_probs"][0])
        state, context = out["vad_state"][0], out["vad_context"][0]
    torch.testing.assert_close(torch.cat(probs), whole["vad_probs"][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(state, whole["vad_state"][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("audio,state,context,match", [
    (torch.zeros(100), torch.zeros(2, 128), torch.zeros(32), "whole windows"),
    (torch.zeros(0), torch.zeros(2, 128), torch.zeros(32), "whole windows"),
    (torch.zeros(256), torch.zeros(2, 64), torch.zeros(32), "vad_state"),
    (torch.zeros(256), torch.zeros(2, 128), torch.zeros(16), "vad_state"),
    (torch.zeros(256, dtype=torch.int16), torch.zeros(2, 128), torch.zeros(32), "float tensors"),
    ([0.0] * 256, torch.zeros(2, 128), torch.zeros(32), "float tensors"),
    (torch.zeros(256 * 7501), torch.zeros(2, 128), torch.zeros(32), "whole windows"),
])
def test_bad_stretches_are_refused(audio, state, context, match):
    info = ForwardInfo("r", "vad", "vad", (), None)
    with pytest.raises(ValueError, match=match):
        SileroVadNode().prepare_inputs("vad", info, {"vad_audio": [audio], "vad_state": [state],
                                                     "vad_context": [context]})
