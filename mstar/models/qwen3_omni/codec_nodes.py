"""Qwen3-Omni's nodes after the Talker (see ``graph.py`` for the walks, ``nodes.py`` for the others):

* ``code_predictor`` (``CodePredictorNode``): one residual code per iteration of ``code_groups``;
* ``frame_assembler`` (``FrameAssembler``): the frame's 16 codes -> ``Code2Wav`` stream, and the sum of
  its code embeddings -> the Talker's next input;
* ``Code2Wav`` (``Code2WavNode``): one stream chunk -> the float32 samples it adds to the waveform
  (``audio``, 24 kHz mono in [-1, 1]; the streamed chunks concatenate to a full-length decode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mstar.layers.sampling import SamplingParams, sample
from mstar.model.submodule import EngineInputs, ForwardInfo, NodeInputs, NodeSubmodule
from mstar.models.qwen3_omni.code2wav import ChunkRequest, Code2Wav, NextChunk, VocoderState
from mstar.models.qwen3_omni.talker import CodePredictor

__all__ = ["Code2WavNode", "CodePredictorNode", "FrameAssembler"]


@dataclass(slots=True)
class _PredictorArgs:
    """A code predictor step's args: which residual code it samples and from what."""

    j: int  # the code group's step in the frame (0: reads the talker hidden and code-0 sum)
    seed_step: int  # the sampler's step (frame * groups + j)
    sampling: SamplingParams
    hidden: torch.Tensor  # the talker's hidden state of the frame
    code: torch.Tensor  # the previous code [1]
    cache: torch.Tensor  # the predictor's cache of the frame so far
    sum: torch.Tensor  # the codes' embedding sum so far


@dataclass(frozen=True, slots=True)
class _Frame:
    """``FrameAssembler``'s args: the frame's codes, whether it is spoken, the codec sum."""

    codes: torch.Tensor
    speak: bool
    sum: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Chunk:
    """``Code2WavNode``'s args: the chunk to decode (None: no new frames), its request, where its new
    frames start in the stream."""

    chunk: ChunkRequest | None
    request_id: str
    new_start: int


def _one(value):
    """A row's value as ``prepare_inputs`` reads it from an edge: the first of its list."""
    return value if isinstance(value, torch.Tensor) else value[0]


def _flat(code: torch.Tensor) -> torch.Tensor:
    """A code as ``[1]`` (the step's own codes already are: no reshape call for them)."""
    return code if code.dim() == 1 else code.reshape(-1)


class CodePredictorNode(NodeSubmodule):
    """Iteration j of ``code_groups``: code j+1 of the frame (``code``), the grown ``cp_cache`` and
    ``cp_sum`` + the new code's embedding."""

    def __init__(self, predictor: CodePredictor) -> None:
        super().__init__()
        self.predictor = predictor
        self._groups = predictor.config.num_code_groups  # read at every step: not through the module

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        frame, j = fwd_info.iteration[-2], fwd_info.iteration[-1]
        code = inputs["code"][0]
        if code.dim() != 1:  # the previous step's code comes as [1] already
            code = code.reshape(-1)
        return NodeInputs(args=_PredictorArgs(j, frame * self._groups + j, fwd_info.params.predictor,
                                              inputs["talker_hidden"][0], code, inputs["cp_cache"][0],
                                              inputs["cp_sum"][0]))

    def continue_batch(self, graph_walk: str | None, engine_inputs: EngineInputs, tensors: Mapping[str, torch.Tensor],
                       outputs: Mapping[str, list]) -> tuple[dict[str, torch.Tensor], list] | None:
        """The next step of every row, as ``prepare_inputs`` makes it of the fed-back ``code``,
        ``cp_cache`` and ``cp_sum``: the step and seed one further, the talker hidden and sampling
        the same."""
        if type(self).prepare_inputs is not CodePredictorNode.prepare_inputs:
            return None
        codes, caches, sums = outputs.get("code"), outputs.get("cp_cache"), outputs.get("cp_sum")
        if codes is None or caches is None or sums is None:
            return None
        return {}, [_PredictorArgs(a.j + 1, a.seed_step + 1, a.sampling, a.hidden, _flat(_one(c)), _one(k), _one(s))
                    for a, c, k, s in zip(engine_inputs.args, codes, caches, sums)]

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        args: list[_PredictorArgs] = engine_inputs.args
        p, steps, kv = self.predictor, [a.j for a in args], [a.cache for a in args]
        if steps[0] > 0 and steps.count(steps[0]) == len(steps):  # the usual batch: one step, one row each
            logits, caches = p.step_rows(p.embed(steps[0] - 1, torch.cat([a.code for a in args])), [1] * len(steps),
                                         steps, kv)
            return self._outputs(logits, caches, args, steps)
        later = [i for i, j in enumerate(steps) if j > 0]  # step 0 reads (talker hidden, code-0 embedding)
        embedded = p.embed_steps([steps[i] - 1 for i in later], torch.cat([args[i].code for i in later])) \
            if later else None
        rows: list[torch.Tensor] = [None] * len(steps)  # type: ignore[list-item]
        for k, i in enumerate(later):
            rows[i] = embedded[k:k + 1]
        for i, j in enumerate(steps):
            if j == 0:
                rows[i] = torch.cat([args[i].hidden, args[i].sum])
        logits, caches = p.step(rows, steps, kv)
        return self._outputs(logits, caches, args, steps)

    def _outputs(self, logits: torch.Tensor, caches: list[torch.Tensor], args: list[_PredictorArgs],
                 steps: list[int]) -> dict[str, list]:
        codes = sample(logits, [a.sampling for a in args], None, [a.seed_step for a in args]).cpu()
        sums = torch.cat([a.sum for a in args]) + self.predictor.embed_steps(steps, codes)
        return {"code": list(codes.view(-1, 1).unbind(0)), "cp_cache": caches, "cp_sum": list(sums.split(1))}


class FrameAssembler(NodeSubmodule):
    """``code0`` + the 15 residual codes -> one ``[16]`` frame on the ``codec_frames`` stream and to the
    client (``frame_codes``; an empty tensor on the last talker step, which has no frame), and
    ``codec_sum`` (the Talker's next codec input)."""

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        codes = [inputs["code0"][0], *inputs["code"]]  # code: one per step, each [1] as the nodes make them
        if any(c.dim() != 1 for c in codes):
            codes = [c.reshape(-1) for c in codes]
        return NodeInputs(args=_Frame(torch.cat(codes), bool(inputs["speak"][0]), inputs["cp_sum"][0]))

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        args: list[_Frame] = engine_inputs.args
        frames = [a.codes if a.speak else a.codes[:0] for a in args]
        # the last step pushes an empty item rather than nothing: every push then carries an item, so
        # a consumer that already saw the stream's end never receives a push (pushes and the end travel
        # from different senders; an empty push could arrive after the end)
        return {"codec_sum": [a.sum for a in args], "frame_codes": frames, "codec_frames": [[f] for f in frames]}


class Code2WavNode(NodeSubmodule):
    """One ``codec_frames`` chunk per request -> ``audio``: float32 samples ``[wave_length(new_end) -
    wave_length(new_start)]`` (Code2Wav's stitching rule), empty for a chunk without frames.

    A request's vocoder state (``VocoderState``: the convolutions' input tails) is kept here from
    chunk to chunk, so each chunk convolves only its new frames (the pre-transformer still reads the
    chunk's left context); it is dropped when the request ends (``release``). The batch's chunks
    decode together (``Code2Wav.decode_next_many``: each request's samples the same bits as alone). A later chunk whose
    state is missing (this rank restarted) takes the stateless decode, exact with the left context
    the graph gives."""

    def __init__(self, code2wav: Code2Wav) -> None:
        super().__init__()
        self.code2wav = code2wav
        self._states: dict[str, VocoderState] = {}

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        items = inputs["codec_frames"]
        chunk = fwd_info.stream_chunks.get("codec_frames") or {"start": 0, "new_start": 0}
        context = int(chunk["new_start"]) - int(chunk["start"])
        frames = [f.reshape(-1) for f in items if f.numel()]  # the talker's last item is empty
        new = sum(1 for f in items[context:] if f.numel())
        if new == 0:
            return NodeInputs(args=_Chunk(None, fwd_info.request_id, 0))
        return NodeInputs(args=_Chunk(ChunkRequest(torch.stack(frames, dim=1), len(frames) - new),
                                      fwd_info.request_id, int(chunk["new_start"])))

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        # the chunks that continue a kept state (or start one) decode together (decode_next_many: each
        # row's samples are the same bits as decoded alone, so a request's audio does not depend on
        # which requests share its step); a chunk whose state is missing takes the stateless decode
        args: list[_Chunk] = engine_inputs.args
        audio: list[torch.Tensor] = [torch.zeros(0)] * len(args)
        staged: dict[str, VocoderState | None] = {}
        nexts: list[tuple[int, str, NextChunk]] = []
        for i, a in enumerate(args):
            chunk, rid, start = a.chunk, a.request_id, a.new_start
            if chunk is None:
                continue
            state = self._states.get(rid) if start > 0 else None
            if start == 0 or (state is not None and state.frames == start):
                nexts.append((i, rid, NextChunk(chunk.codes, chunk.left_context, state)))
            else:
                audio[i], staged[rid] = self.code2wav.decode_chunks([chunk])[0], None
        if nexts:
            for (i, rid, _), (wave, state) in zip(nexts, self.code2wav.decode_next_many([n for _, _, n in nexts])):
                audio[i], staged[rid] = wave, state
        for rid, kept in staged.items():  # kept only once every chunk of the batch decoded
            if kept is None:
                self._states.pop(rid, None)
            else:
                self._states[rid] = kept
        return {"audio": audio}

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
