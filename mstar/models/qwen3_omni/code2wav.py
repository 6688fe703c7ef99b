"""Qwen3-Omni's Code2Wav: codec frames (16 codes each, 12.5 Hz) -> 24 kHz mono waveform.

:class:`Code2Wav` wraps transformers' ``Qwen3OmniMoeCode2Wav`` (built from its config; weights
under ``code2wav.*`` in the checkpoint) as a batched, stateless module:

* ``decode(codes [B, Q, T]) -> [B, wave_length(T)]``: the whole sequence at once (the module's
  forward, clamped to [-1, 1]);
* ``decode_chunk(codes [B, Q, T], left_context) -> list of B 1-D waveforms``: one streamed chunk,
  whose first ``left_context`` frames were already decoded by earlier chunks;
* ``decode_chunks(list of ChunkRequest) -> list of waveforms``: many requests' chunks, one forward
  per group of equal shape.

Lengths. Every decoder block upsamples with a transposed convolution of kernel ``2r`` and stride
``r`` trimmed by ``r`` on both sides, so ``L`` steps become ``(L - 1) * r``: each output sample
needs the *next* input step (one step of look-ahead). For the real config (upsampling 2, 2 then
8, 5, 4, 3) ``n`` frames give ``1920 * n - 555`` samples (:meth:`Code2Wav.wave_length`). The
samples a decode of frames ``[0, n)`` produces depend on those frames only (everything is causal
apart from that look-ahead, which the trimming already excludes).

Stitching rule. A chunk holds frames ``[s - c, e)``: ``c`` frames of left context then the new
frames ``[s, e)``. The stream so far has ``wave_length(s)`` samples, so the chunk emits its
decode's samples ``[wave_length(c), wave_length(e - s + c))``: global samples
``[wave_length(s), wave_length(e))``. The concatenation of a stream's chunks therefore has exactly
the length of a full decode, ``wave_length(n)`` (transformers' ``chunked_decode`` instead drops
``ctx * 1920`` samples, losing 555 at every boundary). A first chunk (``c = 0``) emits everything.

Values. The causal convolutions reach fewer than :data:`CONV_CONTEXT` frames back, so a chunk
convolves only its new frames and that many before them. The pre-transformer attends over a
72-frame sliding window per layer, so with 25 frames of left context a stateless chunk differs from
a full decode after each chunk start (tiny random config: relative L2 ~2e-3; the real config with
random weights: ~0.3). With ``left_context >= exact_left_context`` (``layers * (window - 1) +
CONV_CONTEXT``: 578 frames for the real model, 81 for the tiny one) the transformer sees its whole
reach and a chunk equals the full decode to rounding; the transformer is cheap next to the
convolutions, which still run over ``CONV_CONTEXT`` + new frames only.

Exact streaming with a state (:meth:`Code2Wav.decode_next`, what the served node uses; and
``new_stream`` / ``decode_streams`` over it): per request a :class:`VocoderState` holding, for each
causal convolution of the vocoder, the tail of its input it still needs, and for each transposed
convolution its last input step. Each chunk's frames go through the pre-transformer with their left
context, then only the NEW frames through the vocoder, continuing from those tails: equal to a full
decode to rounding at any chunk sizes (relative L2 ~4e-7 on random weights with audible output),
with no convolution recomputed over context. The state must be dropped when the request ends
(``Code2WavNode.release``).

Batching (:meth:`Code2Wav.decode_next_many`, the node's path): the chunks of one step decode together,
per group of equal new-frame count and alike state, with operators that compute each row as they
would alone (``PreTransformer``, ``BatchVocoder``): a request's samples are the same bits whatever
it shares the step with (figures in BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mstar.layers import cpu_ops
from mstar.model.checkpoint import load_into
from mstar.models.qwen3_omni import kernels
from mstar.models.qwen3_omni.code2wav_batch import BatchVocoder, PreTransformer
from mstar.models.qwen3_omni.code2wav_modules import swap_fast_modules

if TYPE_CHECKING:  # transformers is imported when a Code2Wav is built, not with this module
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

__all__ = ["CONV_CONTEXT", "SAMPLE_RATE", "WEIGHT_PREFIX", "ChunkRequest", "Code2Wav", "Code2WavStream",
           "NextChunk", "to_pcm16"]

SAMPLE_RATE = 24_000
WEIGHT_PREFIX = "code2wav."
# frames of transformer output the convolutions need on the left: their causal kernels reach
# 3 + 1.5 + 1.5 + 2.4 + 0.5 + 0.1 < 10 frames back (ConvNeXt at 2 and 4 steps per frame, the input
# convolution, then the residual units of each decoder block); 5 already agree to rounding
CONV_CONTEXT = 10


@dataclass(frozen=True)
class ChunkRequest:
    """One request's chunk: ``codes`` ``[Q, T]`` (row 0 = layer-0 codes), of which the first
    ``left_context`` frames are context already decoded by an earlier chunk."""

    codes: torch.Tensor
    left_context: int

    def __post_init__(self) -> None:
        if self.codes.dim() != 2:
            raise ValueError(f"chunk codes must be [num_quantizers, frames], got {tuple(self.codes.shape)}")
        if not 0 <= self.left_context < self.codes.shape[1]:
            raise ValueError(f"left_context must be in [0, {self.codes.shape[1]}), got {self.left_context}")


@dataclass(frozen=True)
class VocoderState:
    """What a streamed decode keeps of one request between chunks: the ``frames`` decoded so far and,
    per causal convolution of the vocoder, the tail of its input it still needs (``(kernel - 1) *
    dilation`` steps; the last input step for a transposed convolution, whose outputs need the next
    step too). Immutable: a chunk's decode returns a new state, so a failed decode leaves the old one."""

    frames: int
    tails: Mapping[int, torch.Tensor]  # id of the convolution module -> its kept input [1, C, steps]


@dataclass
class Code2WavStream:
    """One request's exact streaming decode (``new_stream`` / ``decode_streams``): the codes of its
    last ``transformer_context`` frames (the pre-transformer's reach) and the vocoder's state."""

    codes: torch.Tensor  # [Q, <= transformer_context]
    vocoder: VocoderState | None = None
    frames: int = 0


def _config(config: Qwen3OmniMoeCode2WavConfig | Mapping[str, Any]) -> Qwen3OmniMoeCode2WavConfig:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    if isinstance(config, Qwen3OmniMoeCode2WavConfig):
        return config
    if isinstance(config, Mapping):
        return Qwen3OmniMoeCode2WavConfig(**config)
    raise TypeError(f"code2wav config must be a Qwen3OmniMoeCode2WavConfig or a dict, got {type(config).__name__}")


@dataclass(frozen=True)
class NextChunk:
    """One request's next chunk for :meth:`Code2Wav.decode_next_many`: ``codes`` ``[Q, T]`` whose first
    ``left_context`` frames were decoded before, and the request's state (None for its first chunk)."""

    codes: torch.Tensor
    left_context: int
    state: VocoderState | None


class Code2Wav(nn.Module):
    """Batched stateless codec decoder around transformers' ``Qwen3OmniMoeCode2Wav`` (its kernel-1
    and narrow convolutions and its activations through faster paths:
    ``swap_fast_modules``)."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig | Mapping[str, Any]) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        super().__init__()
        self.config = _config(config)
        self.model = Qwen3OmniMoeCode2Wav(self.config).eval()
        swap_fast_modules(self.model)
        self.num_quantizers = int(self.config.num_quantizers)
        self.codebook_size = int(self.config.codebook_size)
        self.upsampling_ratios = tuple(int(r) for r in self.config.upsampling_ratios)
        self.upsample_rates = tuple(int(r) for r in self.config.upsample_rates)
        self.samples_per_frame = int(self.model.total_upsample)
        # transposed convolutions' weights as taps, ConvNeXt blocks' pointwise layers packed (BatchVocoder)
        self._taps: dict[Any, tuple[object, Any]] = {}
        self._pre = PreTransformer(self.model)

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    def wave_length(self, frames: int) -> int:
        """Samples a decode of ``frames`` frames produces (0 for 0 frames)."""
        if frames <= 0:
            return 0
        steps = frames
        for ratio in self.upsampling_ratios:  # kernel == stride: exact multiple
            steps *= ratio
        for rate in self.upsample_rates:  # kernel 2r, stride r, trimmed by r on both sides
            steps = (steps - 1) * rate
        return max(steps, 0)

    def emit_range(self, frames: int, left_context: int) -> tuple[int, int]:
        """The samples of a ``frames``-frame decode that a chunk with ``left_context`` context
        frames emits: ``[wave_length(left_context), wave_length(frames))``."""
        return self.wave_length(left_context), self.wave_length(frames)

    def load_weights(self, state: Mapping[str, torch.Tensor], prefix: str = WEIGHT_PREFIX) -> None:
        """Copy the ``prefix``-named tensors of a checkpoint state dict (strict: every mismatch is a
        ``CheckpointError``); tensors with other prefixes are ignored."""
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        load_into(self.model, own, what=f"checkpoint '{prefix}*' tensors")

    def _check_codes(self, codes: torch.Tensor, values: bool = True) -> None:
        """``codes`` ``[B, Q, T]`` with every value a code of the codebook (``values=False``: the shape only)."""
        if codes.dim() != 3 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [batch, {self.num_quantizers}, frames], got {tuple(codes.shape)}")
        if values and codes.numel():
            low, high = torch.aminmax(codes)
            if int(low) < 0 or int(high) >= self.codebook_size:
                raise ValueError(f"codes must lie in [0, {self.codebook_size})")

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ``[B, Q, T]`` -> waveform ``[B, wave_length(T)]`` (float32, in [-1, 1])."""
        self._check_codes(codes)
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 0)
        wav = self.model(codes.long().to(self._device()))
        return wav[:, 0].float()

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, Q, T]`` codes -> the mean of their 16 code embeddings ``[B, T, H]``."""
        return self.model.code_embedding(codes.long().to(self._device()) + self.model.code_offset).mean(1)

    def _vocode(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformer outputs ``[B, T, H]`` -> waveform ``[B, wave_length(T)]`` (the convolutions)."""
        x = hidden.transpose(1, 2)
        for stage in self.model.upsample:
            for block in stage:
                x = block(x)
        for block in self.model.decoder:
            x = block(x)
        return x.clamp(min=-1, max=1)[:, 0].float()

    def new_stream(self) -> Code2WavStream:
        return Code2WavStream(torch.zeros(self.num_quantizers, 0, dtype=torch.long))

    @torch.inference_mode()
    def decode_streams(self, streams: Sequence[Code2WavStream], codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each stream's next frames (``codes[i]`` ``[Q, n_i]``, ``n_i >= 1``) -> the samples they add
        (``wave_length(total) - wave_length(before)``), decoded together (``decode_next_many``: each
        stream's samples are the same bits as decoded alone)."""
        chunks = [torch.cat([stream.codes, new.to(stream.codes)], dim=1) for stream, new in zip(streams, codes)]
        decoded = self.decode_next_many([NextChunk(chunk, stream.codes.shape[1], stream.vocoder)
                                         for stream, chunk in zip(streams, chunks)])
        out = []
        for stream, chunk, new, (wave, state) in zip(streams, chunks, codes, decoded):
            stream.vocoder = state
            stream.codes = chunk[:, max(0, chunk.shape[1] - self.transformer_context):]
            stream.frames += new.shape[1]
            out.append(wave)
        return out

    @torch.inference_mode()
    def decode_next(self, codes: torch.Tensor, left_context: int, state: VocoderState | None
                    ) -> tuple[torch.Tensor, VocoderState]:
        """A request's next chunk with the state of its earlier ones: ``codes`` ``[Q, T]`` whose first
        ``left_context`` frames were decoded before (at least ``transformer_context`` of them, or
        all frames so far) -> (the new frames' samples, the state after them). ``state`` is None
        for the first chunk. The pre-transformer runs over the whole chunk; the vocoder only over
        the new frames, from the kept tails (``VocoderState``): no recomputed context. Equals a
        full decode to float rounding at any chunk sizes; :meth:`decode_next_many` of one chunk."""
        return self.decode_next_many([NextChunk(codes, left_context, state)])[0]

    @torch.inference_mode()
    def decode_next_many(self, chunks: Sequence[NextChunk]) -> list[tuple[torch.Tensor, VocoderState]]:
        """:meth:`decode_next` for many requests' chunks: (samples, new state) per chunk, in order.
        The pre-transformer runs per request; the vocoder over each group of chunks with as many new
        frames and alike states (all first chunks, or all continuing), as one batch when the compiled
        kernels are there (``BatchVocoder``: every row's samples are the same bits as decoded alone),
        else one request at a time."""
        for c in chunks:
            self._check_codes(c.codes[None], values=False)
            if not 0 <= c.left_context < c.codes.shape[1]:
                raise ValueError(f"left_context must be in [0, {c.codes.shape[1]}), got {c.left_context}")
            if (c.state.frames if c.state is not None else 0) < c.left_context:
                raise ValueError("the state has fewer frames than the chunk's left context")
        groups_by_length = list(_groups(c.codes.shape[1] for c in chunks).values())
        stacked = [torch.stack([chunks[i].codes for i in rows]) for rows in groups_by_length]
        for codes in stacked:  # the values, one check per group of equal lengths (before any work)
            self._check_codes(codes)
        hidden: list[torch.Tensor] = [None] * len(chunks)  # type: ignore[list-item]  # [H, new] per chunk
        for rows, codes in zip(groups_by_length, stacked):
            embeds = self._embed(codes)
            if self._pre.usable(embeds):
                out = self._pre(embeds)
            else:  # transformers' module, one request at a time (its batched rows round differently)
                out = torch.cat([self.model.pre_transformer(inputs_embeds=e[None]).last_hidden_state for e in embeds])
            for b, i in enumerate(rows):
                hidden[i] = out[b, chunks[i].left_context:].t()
        batched = (cpu_ops.ops() is not None and kernels.ops() is not None
                   and all(h.device.type == "cpu" and h.dtype == torch.float32 for h in hidden))
        keys = [(h.shape[1], c.state is None) for h, c in zip(hidden, chunks)]
        groups = _groups(keys) if batched else {i: [i] for i in range(len(chunks))}
        out: list[tuple[torch.Tensor, VocoderState] | None] = [None] * len(chunks)
        for rows in groups.values():
            states = [chunks[i].state for i in rows]
            old = None if states[0] is None else {k: torch.cat([s.tails[k] for s in states])  # type: ignore[union-attr]
                                                  for k in states[0].tails}
            vocoder = BatchVocoder(old, self._taps)
            x = torch.stack([hidden[i] for i in rows])  # [B, H, new]
            for stage in self.model.upsample:
                x = vocoder.sequence(stage, x)
            x = vocoder.sequence(self.model.decoder, x)
            wave = x.clamp(min=-1, max=1)[:, 0].float()
            # one copy of each convolution's tails for the batch (not views of its activations); a
            # row's state holds views of those small copies
            kept = {k: v.clone().split(1) for k, v in vocoder.new.items()}
            for b, i in enumerate(rows):
                c = chunks[i]
                frames = (c.state.frames if c.state is not None else 0) + c.codes.shape[1] - c.left_context
                out[i] = (wave[b].clone(), VocoderState(frames, {k: parts[b] for k, parts in kept.items()}))
        return out  # type: ignore[return-value]

    @property
    def transformer_context(self) -> int:
        """Frames of left context the pre-transformer reaches (``layers * (window - 1)``)."""
        return int(self.config.num_hidden_layers) * (int(self.config.sliding_window) - 1)

    def decode_chunk(self, codes: torch.Tensor, left_context: int) -> list[torch.Tensor]:
        """One chunk of each of ``B`` rows with the same ``left_context``: the new samples of each
        row (``wave_length(T) - wave_length(left_context)`` of them)."""
        return self.decode_chunks([ChunkRequest(row, left_context) for row in codes])

    @torch.inference_mode()
    def decode_chunks(self, chunks: Sequence[ChunkRequest]) -> list[torch.Tensor]:
        """Chunks of many requests, in the order given. The transformer runs over every frame of a
        chunk (one forward per group of equal frame count); the convolutions only over the new
        frames and the :data:`CONV_CONTEXT` before them (their reach), which gives the same samples
        as convolving the whole chunk."""
        hidden: list[torch.Tensor | None] = [None] * len(chunks)
        for rows in _groups(chunk.codes.shape[1] for chunk in chunks).values():
            codes = torch.stack([chunks[i].codes for i in rows])
            self._check_codes(codes)
            out = self.model.pre_transformer(inputs_embeds=self._embed(codes)).last_hidden_state
            for row, i in enumerate(rows):
                hidden[i] = out[row]
        pieces = []
        for chunk, h in zip(chunks, hidden):
            keep = min(CONV_CONTEXT, chunk.left_context)
            pieces.append((keep, h[chunk.left_context - keep:]))
        return self._vocode_pieces(pieces)

    def _vocode_pieces(self, pieces: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """``(context frames, transformer outputs [T, H])`` pairs -> the samples of the frames after
        the context; one convolution pass per group of equal length."""
        out: list[torch.Tensor | None] = [None] * len(pieces)
        for frames, rows in _groups(h.shape[0] for _, h in pieces).items():
            wav = self._vocode(torch.stack([pieces[i][1] for i in rows]))
            for row, i in enumerate(rows):
                start, end = self.emit_range(frames, pieces[i][0])
                out[i] = wav[row, start:end]
        return out  # type: ignore[return-value]

    @property
    def exact_left_context(self) -> int:
        """The left context that makes a stateless chunk exact: the transformer's reach
        (``layers * (window - 1)`` frames) plus the convolutions' (:data:`CONV_CONTEXT`)."""
        return int(self.config.num_hidden_layers) * (int(self.config.sliding_window) - 1) + CONV_CONTEXT

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


def _groups(sizes: Iterable[int]) -> dict[int, list[int]]:
    """Indices by size, in order: the rows that can share one forward."""
    out: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):
        out.setdefault(size, []).append(i)
    return out


def to_pcm16(wave: torch.Tensor) -> torch.Tensor:
    """A float waveform in [-1, 1] as int16 PCM (scaled by 32767, rounded, clamped)."""
    return (wave.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
