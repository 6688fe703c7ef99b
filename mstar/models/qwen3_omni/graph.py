"""Qwen3-Omni's Walk Graph: Thinker -> Talker -> Code2Wav, three partitions streaming in a chain.

::

    Thinker   thinker_prefill: input_ids -> Thinker -> token, seen, rope_delta (state), text (client),
                               thinker_states ~> Talker
              thinker_prefill_{audio_in,image_in,audio_in_image_in}: the towers first (audio_encoder:
                               audio_features -> audio_embeds; vision_encoder: pixel_values, image_grid_thw
                               -> image_embeds, deepstack), then the Thinker with their outputs
              thinker_decode:  DynamicLoop(Thinker: token, seen, rope_delta -> token, seen (fed back), text,
                                           thinker_states ~>)
              (text-only requests run the *_text twins, which stream nothing)
    Talker    talker_prefill[_image_in]: thinker_states (the prompt block), input_ids[, image_grid_thw]
                               -> Talker -> codec_sum, talker_seen, talker_delta (state)
              talker_decode:   DynamicLoop(
                                 Talker: thinker_states (one generated position per iteration), codec_sum,
                                         talker_seen, talker_delta -> code0, talker_hidden, ... ,
                                 Loop x15(code_predictor: talker_hidden, code, cp_cache, cp_sum -> code, ...),
                                 frame_assembler: code0, speak, code (15), cp_sum -> codec_sum (fed back),
                                                  frame_codes (client), codec_frames ~> Code2Wav)
    Code2Wav  code2wav_chunk:  codec_frames (5, 10, 20, then 25 new frames + left context) -> Code2Wav -> audio
    Thinker   vad:             vad_audio, vad_state, vad_context -> vad (Silero VAD, ``mstar.layers.vad``)
                               -> vad_probs, vad_state, vad_context (client): a ``VadRequest``'s only walk

Stream items: the Thinker's prefill pushes ONE item, the prompt's ``[P, 2, H]`` (input embeddings and
the ``accept_hidden_layer`` output per position); each decode iteration pushes the ``[1, 2, H]`` of the
token it fed. ``FixedChunkPolicy(chunk_size=1, continue_after_done=True)`` hands the Talker one
item per walk / iteration and, once the Thinker ended, empty final chunks (the Talker then adds
``tts_eos`` once, then ``tts_pad``). The Talker prefills the user turn and the first 8 assistant
positions in ``talker_prefill``; iteration 0 of ``talker_decode`` brings the 9th position (the first
generated token's text + ``codec_bos``), so the Talker trails the Thinker by one token.

The code predictor is a fixed ``Loop`` of 15 steps nested in the Talker's ``DynamicLoop``: step 0
reads ``[talker hidden, E(code0)]``, each later step the previous code's embedding; its per-frame
cache (``cp_cache``) and the running sum of the frame's code embeddings (``cp_sum``, the next
Talker input) are carried from step to step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.graph import (
    EMIT_TO_CLIENT,
    TO_STATE,
    Connection,
    DynamicLoop,
    FixedChunkPolicy,
    GraphEdge,
    GraphNode,
    LeftContextChunkPolicy,
    Loop,
    PartitionTopology,
    Sequential,
    StreamingGraphEdge,
    Walk,
    WalkGraph,
)
from mstar.layers.vad import VAD_WALK, VadRequest, vad_walk
from mstar.model.decode import prefill_finish

if TYPE_CHECKING:
    from mstar.model.base import WalkState

__all__ = ["CODE2WAV_CHUNK", "CODE2WAV_FIRST_CHUNK", "CODE2WAV_LEFT_CONTEXT", "NUM_CODE_GROUPS", "build_graph", "code2wav_exact_context",
           "next_walk", "prefill_walk_name", "wants_audio"]

NUM_CODE_GROUPS = 16  # the released checkpoints' (talker_config.num_code_groups); build_graph takes the config's
CODE2WAV_CHUNK = 25
CODE2WAV_FIRST_CHUNK = 5  # the first audio after 5 frames (0.4 s); then 10, 20, 25, 25, ... new frames
CODE2WAV_LEFT_CONTEXT = 25  # the seeds' value; the model passes its exact context (see build_graph)


def wants_audio(request) -> bool:
    """Whether a request (an ``OmniRequest``) asks for speech (default: text only; a ``VadRequest`` never)."""
    return getattr(request, "audio", False)


def _prefill_section(outputs: list[GraphEdge], audio_in: bool, image_in: bool):
    """The Thinker's prefill, after the towers the request's media need (each tower's embeddings
    replace its placeholders; the vision tower's deepstack features join the first layers)."""
    towers, thinker_inputs = [], ["input_ids"]
    if audio_in:
        towers.append(GraphNode("audio_encoder", ["audio_features"], [GraphEdge("Thinker", "audio_embeds")]))
        thinker_inputs.append("audio_embeds")
    if image_in:
        towers.append(GraphNode("vision_encoder", ["pixel_values", "image_grid_thw"],
                                [GraphEdge("Thinker", "image_embeds"), GraphEdge("Thinker", "deepstack")]))
        thinker_inputs += ["image_embeds", "deepstack", "image_grid_thw"]
    thinker = GraphNode("Thinker", thinker_inputs, outputs)
    return Sequential([*towers, thinker]) if towers else thinker


def prefill_walk_name(audio_in: bool, image_in: bool, audio_out: bool) -> str:
    return "thinker_prefill" + "_audio_in" * audio_in + "_image_in" * image_in + "_text" * (not audio_out)


def _thinker_walks(max_text_tokens: int) -> list[Walk]:
    text_out = GraphEdge(EMIT_TO_CLIENT, "text", output_modality="text")
    states = StreamingGraphEdge(next_node="Talker", name="thinker_states", target_partition="Talker")
    walks = []
    for audio_out in (True, False):
        extra = [states] if audio_out else []
        outputs = [GraphEdge(TO_STATE, "token"), GraphEdge(TO_STATE, "seen"), GraphEdge(TO_STATE, "rope_delta"),
                   GraphEdge(TO_STATE, "stop"), text_out, *extra]
        for audio_in in (False, True):
            for image_in in (False, True):
                inputs = ["input_ids", *["audio_features"] * audio_in,
                          *["pixel_values", "image_grid_thw"] * image_in]
                walks.append(Walk(prefill_walk_name(audio_in, image_in, audio_out),
                                  _prefill_section(outputs, audio_in, image_in), inputs=inputs,
                                  partition="Thinker"))
        suffix = "" if audio_out else "_text"
        decode = DynamicLoop(GraphNode("Thinker", ["token", "seen", "rope_delta"],
                                       [GraphEdge("Thinker", "token"), GraphEdge("Thinker", "seen"), text_out,
                                        *extra]),
                             max_iters=max_text_tokens, name=f"thinker_loop{suffix}")
        walks.append(Walk(f"thinker_decode{suffix}", decode, inputs=["token", "seen", "rope_delta"],
                          partition="Thinker"))
    return walks


def _talker_walks(max_frames: int, num_code_groups: int) -> list[Walk]:
    prefill_out = [GraphEdge(TO_STATE, "codec_sum"), GraphEdge(TO_STATE, "talker_seen"),
                   GraphEdge(TO_STATE, "talker_delta")]
    prefill = GraphNode("Talker", ["thinker_states", "input_ids"], prefill_out)
    prefill_image = GraphNode("Talker", ["thinker_states", "input_ids", "image_grid_thw"], prefill_out)
    talker = GraphNode("Talker", ["thinker_states", "codec_sum", "talker_seen", "talker_delta"], [
        GraphEdge("Talker", "talker_seen"),
        GraphEdge("code_predictor", "talker_hidden"), GraphEdge("code_predictor", "code"),
        GraphEdge("code_predictor", "cp_cache"), GraphEdge("code_predictor", "cp_sum"),
        GraphEdge("frame_assembler", "code0"), GraphEdge("frame_assembler", "speak"),
    ])
    groups = Loop(
        GraphNode("code_predictor", ["talker_hidden", "code", "cp_cache", "cp_sum"],
                  [GraphEdge("code_predictor", "code"), GraphEdge("code_predictor", "cp_cache"),
                   GraphEdge("code_predictor", "cp_sum")]),
        max_iters=num_code_groups - 1,
        outputs=[GraphEdge("frame_assembler", "code"), GraphEdge("frame_assembler", "cp_sum")],
        accumulate=["code"],
        name="code_groups",
    )
    assembler = GraphNode("frame_assembler", ["code0", "speak", "code", "cp_sum"], [
        GraphEdge("Talker", "codec_sum"), GraphEdge(EMIT_TO_CLIENT, "frame_codes"),
        StreamingGraphEdge("Code2Wav", "codec_frames", target_partition="Code2Wav"),
    ])
    decode = DynamicLoop(Sequential([talker, groups, assembler]), max_iters=max_frames, stop_node="Talker",
                         name="talker_loop")
    return [Walk("talker_prefill", prefill, inputs=["input_ids"], partition="Talker"),
            Walk("talker_prefill_image_in", prefill_image, inputs=["input_ids", "image_grid_thw"],
                 partition="Talker"),
            Walk("talker_decode", decode, inputs=["codec_sum", "talker_seen", "talker_delta"], partition="Talker")]


def code2wav_exact_context(num_layers: int, sliding_window: int, conv_context: int = 10) -> int:
    """Left context (frames) that makes every streamed Code2Wav chunk equal a full decode: the
    pre-transformer's reach (``layers * (window - 1)``) plus the causal convolutions'."""
    return num_layers * (sliding_window - 1) + conv_context


def build_graph(max_text_tokens: int = 2048, max_frames: int = 4096,
                code2wav_left_context: int = CODE2WAV_LEFT_CONTEXT,
                code2wav_first_chunk: int = CODE2WAV_FIRST_CHUNK,
                num_code_groups: int = NUM_CODE_GROUPS) -> WalkGraph:
    """``code2wav_left_context``: frames of context each Code2Wav chunk re-reads. The seeds' 25 is
    shorter than the pre-transformer's reach, so a served model passes ``code2wav_exact_context``
    of its config (the convolutions still run over only 10 + new frames). ``code2wav_first_chunk``:
    new frames of the first chunk, doubling up to ``CODE2WAV_CHUNK`` (time to first audio).
    ``num_code_groups``: codes per frame (the Talker's one, then the code predictor's loop over the
    others), the config's ``talker_config.num_code_groups``."""
    if num_code_groups < 2:
        raise ValueError(f"num_code_groups must be at least 2, got {num_code_groups}")
    audio_out = GraphEdge(EMIT_TO_CLIENT, "audio", output_modality="audio")
    code2wav = GraphNode("Code2Wav", ["codec_frames"], [audio_out])
    topology = PartitionTopology(connections=[
        Connection("Thinker", "Talker", "thinker_states",
                   lambda: FixedChunkPolicy(chunk_size=1, continue_after_done=True)),
        Connection("Talker", "Code2Wav", "codec_frames",
                   lambda: LeftContextChunkPolicy(chunk=CODE2WAV_CHUNK, left_context=code2wav_left_context,
                                                  first_chunk=code2wav_first_chunk)),
    ])
    return WalkGraph([*_thinker_walks(max_text_tokens), *_talker_walks(max_frames, num_code_groups),
                      Walk("code2wav_chunk", code2wav, partition="Code2Wav"), vad_walk("Thinker")], topology=topology)


def next_walk(state: WalkState) -> str | None:
    """Thinker: the prefill for the request's media (towers for ``audio_features`` / ``pixel_values``),
    then decode unless the prefill's token is the last (its stop flag; the *_text twins when no audio
    is asked for); Talker:
    prefill, then one decode walk, for audio requests only; Code2Wav: one walk per chunk until the
    stream is drained."""
    audio = wants_audio(state.params)
    images = bool(state.tensors.get("pixel_values"))
    if state.partition == "Thinker":
        if isinstance(state.params, VadRequest):  # a stretch of a realtime session's audio: VAD only
            return VAD_WALK if state.last_walk is None else None
        if state.last_walk is None:
            return prefill_walk_name(bool(state.tensors.get("audio_features")), images, audio)
        if state.last_walk.startswith("thinker_prefill") and prefill_finish(state) is None:
            return "thinker_decode" if audio else "thinker_decode_text"
        return None
    if state.partition == "Talker":
        if not audio:
            return None
        if state.last_walk is None:
            return "talker_prefill_image_in" if images else "talker_prefill"
        return "talker_decode" if state.last_walk.startswith("talker_prefill") else None
    return None if state.stream_done else "code2wav_chunk"
