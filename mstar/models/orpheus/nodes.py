"""Orpheus TTS's nodes: ``LLM`` (the Llama speech LM, which also streams its audio tokens) and
``snac_decoder`` (audio tokens -> PCM16 through SNAC, chunk by chunk)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import snac
import torch

from mstar.layers.sampling import sample
from mstar.model.submodule import EngineInputs, ForwardInfo, NodeInputs, NodeSubmodule
from mstar.models.llama.nodes import LlamaCausalLM, sampling_of, steps_of
from mstar.models.orpheus.codec import (
    AUDIO_TOKEN_BASE,
    CODE_SIZE,
    FRAME_LEVEL_POSITIONS,
    TOKENS_PER_FRAME,
    frame_codes,
    levels_frame_major,
    plan_chunk,
    to_pcm16,
)
from mstar.models.orpheus.config import STOP_TOKEN
from mstar.models.orpheus.loader import samples_per_frame

log = logging.getLogger(__name__)

__all__ = ["OrpheusLM", "SnacDecoderNode"]


class OrpheusLM(LlamaCausalLM):
    """The Llama node, plus ``audio_token``: the sampled token when it is an audio token, else nothing.

    ``constrain_audio``: sample only the stop token or the audio tokens valid at the next position
    (the i-th generated token can only carry a code of SNAC position i % 7). Off for real
    checkpoints (the reference does not constrain); on for orpheus-tiny, whose random weights would
    otherwise produce invalid codes and hence silence.

    ``candidate_logits`` (with ``constrain_audio``): compute only the 4,097 logits that can be
    sampled (the default), or the whole head and then take those 4,097 from it (the head's
    arithmetic of an unconstrained checkpoint, which engines constraining with a logits processor
    pay; the benchmarks against them use it). Same seed, same tokens (up to the float rounding of
    the two ways to the same logits).
    """

    constrain_audio = False
    candidate_logits = True

    @property
    def vocab_parallel_head(self) -> bool:
        """Candidate logits read rows of the head's weight: under tensor parallelism the head then
        stays whole on every rank."""
        return not (self.constrain_audio and self.candidate_logits)

    def prepack(self) -> bool:
        """The head is prepacked when its logits come from ``compute_logits`` (all but the candidate
        path, which multiplies slices of the plain weight)."""
        return not (self.constrain_audio and self.candidate_logits) and self.prepack_head()

    def sample_next(self, last, engine_inputs):
        if not self.constrain_audio:
            return super().sample_next(last, engine_inputs)
        # Only the stop token and the 4096 audio tokens of the next position can be sampled: their
        # logits (in vocabulary order, so the seeded draw equals a full-vocabulary sample with every
        # other logit masked) are sampled among, then mapped back to token ids. With
        # candidate_logits they alone are computed (the window is a contiguous slice of the head:
        # one small matmul per row, no gather); else the whole head, then gathered.
        ei = engine_inputs
        weight = self.lm_head.weight
        cols, rows = [], []
        full = None if self.candidate_logits else self.process_logits(self.compute_logits(last), ei)
        steps = steps_of(ei)
        for r, step in enumerate(steps):
            lo = AUDIO_TOKEN_BASE + (step % TOKENS_PER_FRAME) * CODE_SIZE
            cols.append(torch.cat([torch.tensor([STOP_TOKEN]), torch.arange(lo, lo + CODE_SIZE)]))
            if full is None:
                rows.append(torch.cat([last[r:r + 1] @ weight[STOP_TOKEN:STOP_TOKEN + 1].T,
                                       last[r:r + 1] @ weight[lo:lo + CODE_SIZE].T], dim=1))
        logits = torch.cat(rows) if full is None else full.gather(1, torch.stack(cols).to(full.device))
        seen = self.seen_lists(ei)
        if seen is not None:  # the penalty counts only tokens that are candidates here: map them
            seen = [[0 if t == STOP_TOKEN else 1 + t - int(c[1]) for t in s
                     if t == STOP_TOKEN or int(c[1]) <= t < int(c[1]) + CODE_SIZE] for c, s in zip(cols, seen)]
        picked = sample(logits, sampling_of(ei), seen, steps).cpu()
        return torch.stack([c[i] for c, i in zip(cols, picked)])

    def forward(self, graph_walk, engine_inputs, ids):
        out = super().forward(graph_walk, engine_inputs, ids)
        out["audio_token"] = [[t] if int(t) >= AUDIO_TOKEN_BASE else [] for t in out["token"]]
        return out


_NO_CHUNK = {"start": 0, "new_start": 0, "is_final": True}


class SnacDecoderNode(NodeSubmodule):
    """The ``snac_decoder`` node: one chunk of audio tokens per request -> int16 PCM (``audio``).

    Input ``audio_token``: the chunk's items (1-element int64 tensors, one per audio token).
    Output ``audio``: per request, a 1-D int16 tensor (possibly empty) of the samples this chunk
    emits under the streaming rule of ``codec.py``.

    Batching: ``prepare_inputs`` gives each request's codes *frame-major*: ``codes_0`` [F, 1],
    ``codes_1`` [F, 2], ``codes_2`` [F, 4] (row f = frame f's codes of that level, in reference
    order), so that the engine can concatenate requests with different frame counts on dim 0, and a
    chunk that decodes nothing contributes 0 rows. ``forward`` regroups the requests by frame count
    and runs ONE ``snac.decode`` over each group (all full windows have 4 frames: the common case is
    a single call for the whole batch).
    """

    INPUT = "audio_token"
    OUTPUT = "audio"
    CODE_NAMES = ("codes_0", "codes_1", "codes_2")

    def __init__(self, snac_model: snac.SNAC):
        super().__init__()
        if len(snac_model.vq_strides) != len(FRAME_LEVEL_POSITIONS):
            raise ValueError(f"Orpheus needs a 3-level SNAC, got vq_strides={snac_model.vq_strides}")
        self.snac = snac_model
        self.samples_per_frame = samples_per_frame(snac_model)
        self.sampling_rate = int(snac_model.sampling_rate)
        self.num_invalid_windows = 0  # chunks emitted as silence because of out-of-range codes

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        items = inputs[self.INPUT]
        chunk = fwd_info.stream_chunks.get(self.INPUT) or _NO_CHUNK
        start = int(chunk["start"])
        plan = plan_chunk(len(items), start, int(chunk["new_start"]), bool(chunk["is_final"]))
        frames = plan.num_frames
        valid = True
        if frames:
            tokens = torch.cat([torch.as_tensor(x).reshape(-1) for x in items[: frames * TOKENS_PER_FRAME]]).cpu()
            if tokens.numel() != frames * TOKENS_PER_FRAME:
                raise ValueError(f"{self.INPUT} items must hold one token each")
            codes, valid = frame_codes(tokens, start)
            if not valid:
                self.num_invalid_windows += 1
                log.debug("request %s: audio tokens %d..%d hold invalid SNAC codes; emitting silence",
                          fwd_info.request_id, start, start + len(items) - 1)
                codes = codes[:0]
        else:
            codes = torch.empty(0, TOKENS_PER_FRAME, dtype=torch.long)
        levels = levels_frame_major(codes)
        s = self.samples_per_frame
        return NodeInputs(tensor_inputs=dict(zip(self.CODE_NAMES, levels, strict=True)),
                          args=(plan.emit_from * s, plan.emit_to * s))  # the samples of the chunk to keep

    def decode_kept(self, engine_inputs: EngineInputs, codes_0: torch.Tensor, codes_1: torch.Tensor,
                    codes_2: torch.Tensor) -> list[torch.Tensor]:
        """Per request, the float audio samples to emit (zeros for silenced chunks)."""
        levels = [engine_inputs.split(name, t) for name, t in zip(self.CODE_NAMES, (codes_0, codes_1, codes_2),
                                                                    strict=True)]
        keep: list[tuple[int, int]] = engine_inputs.args
        param = next(self.snac.parameters())
        out: list[torch.Tensor | None] = [None] * engine_inputs.batch_size
        groups: dict[int, list[int]] = {}
        for i, piece in enumerate(levels[0]):
            if piece.shape[0]:
                groups.setdefault(piece.shape[0], []).append(i)
        with torch.inference_mode():
            for frames, idxs in groups.items():
                codes = [torch.stack([lvl[i].reshape(-1) for i in idxs]).to(param.device) for lvl in levels]
                audio = self.snac.decode(codes)
                if audio.shape[-1] != frames * self.samples_per_frame:
                    raise RuntimeError(f"SNAC decoded {frames} frames to {audio.shape[-1]} samples, expected "
                                       f"{frames * self.samples_per_frame}")
                for row, i in enumerate(idxs):
                    lo, hi = keep[i]
                    out[i] = audio[row, 0, lo:hi]
        for i, a in enumerate(out):
            if a is None:
                lo, hi = keep[i]
                out[i] = torch.zeros(hi - lo, dtype=param.dtype, device=param.device)
        return out  # type: ignore[return-value]

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs,
                **tensors: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        kept = self.decode_kept(engine_inputs, *(tensors[n] for n in self.CODE_NAMES))
        return {self.OUTPUT: [to_pcm16(a) for a in kept]}
