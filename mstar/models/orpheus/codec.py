"""Orpheus TTS's audio tokens -> SNAC codes -> 24 kHz PCM16 audio: the rules the ``snac_decoder``
node (``nodes.SnacDecoderNode``) applies to every chunk.

Audio tokens
    The LLM emits audio tokens ``t >= AUDIO_TOKEN_BASE`` (128266). The ``i``-th audio token of a
    request (0-based, counting audio tokens only) carries the SNAC code
    ``t - 128266 - (i % 7) * 4096``; a code is valid in ``[0, 4096)`` (0 included). Seven
    consecutive tokens, starting at an index that is a multiple of 7, form one *frame*; the frame's
    positions feed SNAC's three levels: L0 <- position 0, L1 <- positions 1, 4 and L2 <- positions
    2, 3, 5, 6, so F frames give codes of shapes [1, F], [1, 2F], [1, 4F] (:func:`tokens_to_codes`).

Samples per frame
    SNAC decodes one frame to ``S = vq_strides[0] * prod(decoder_rates)`` samples
    (see :func:`mstar.models.orpheus.loader.samples_per_frame`): S = 4 * 512 = 2048 for the
    real 24 kHz codec, hence the reference's ``audio[2048:4096]``. Here S is always taken from the
    model, so any SNAC config works.

Streaming rule
    The LLM partition streams every audio token (a 1-element int64 tensor) to the ``snac_decoder``
    node through ``SlidingWindowChunkPolicy(window=28, stride=7)``; each chunk is one firing of the
    node, and for each chunk the node emits one int16 tensor (possibly empty):

    1. Window (every chunk fired by ``push``): 28 tokens = 4 frames starting at a frame boundary
       (stream indices ``k-28 .. k-1`` for ``k = 28, 35, 42, ...``). The 4 frames are decoded
       together and samples ``[S, 2S)`` -- the audio of the window's second frame -- are emitted.
       This is exactly the Orpheus reference streaming decoder (it decodes the last 28 tokens each
       time the count of audio tokens reaches a multiple of 7 that is >= 28, and keeps
       ``[2048:4096]``). As in the reference, the audio of the stream's first frame and of its last
       two whole frames is never emitted: a stream of N >= 4 whole frames yields N - 3 frames of
       audio (frame j, 1 <= j <= N - 3, is emitted by the window of frames j-1 .. j+2).
    2. Final chunk after windows (``finish`` flushing a trailing 1..6 tokens, i.e. a partial
       frame): nothing is emitted (empty tensor), as in the reference, which ignores a trailing
       partial frame and never flushes.
    3. Final chunk holding the whole stream (fewer than 28 tokens, so no window ever fired:
       ``start == new_start == 0``): its whole frames (``len // 7``; a trailing partial frame is
       dropped) are decoded together and all ``frames * S`` samples are emitted. The reference emits
       nothing for such short streams; we return the audio rather than silence the request.

    A node input without chunk information (not streamed) is treated like rule 3.
    Any other chunk shape (another window/stride) is rejected with ValueError.

Invalid codes
    If a chunk to be decoded holds a code outside ``[0, 4096)`` (e.g. a non-audio token), the
    reference skips that window entirely, which shifts the rest of the audio earlier in time. We
    instead emit *silence* (zeros) of the length the chunk would have produced (S samples for a
    window, ``frames * S`` for rule 3), so the stream's timing stays intact, and count it in
    :attr:`nodes.SnacDecoderNode.num_invalid_windows`. Like the reference, the check covers all 28
    tokens of a window, so one bad token silences every window containing it (up to 4). Unlike some
    reference versions, code 0 is valid (the reference drops tokens whose code is 0, which
    misaligns every following frame).

PCM conversion: ``round(clamp(audio, -1, 1) * 32767)`` as int16 (the reference truncates
``audio * 32767`` toward zero instead; the two differ by at most one LSB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AUDIO_TOKEN_BASE",
    "CODE_SIZE",
    "FRAME_LEVEL_POSITIONS",
    "TOKENS_PER_FRAME",
    "WINDOW_FRAMES",
    "WINDOW_TOKENS",
    "ChunkPlan",
    "OrpheusAudioTokens",
    "frame_codes",
    "is_audio_token",
    "levels_frame_major",
    "plan_chunk",
    "to_pcm16",
    "tokens_to_codes",
]


class OrpheusAudioTokens:
    """Orpheus's audio-token vocabulary: token id <-> SNAC code."""

    AUDIO_TOKEN_BASE = 128266  # = 128256 (Llama-3 vocab) + 10: <custom_token_10>
    CODE_SIZE = 4096  # SNAC codebook size: valid codes are [0, CODE_SIZE)
    TOKENS_PER_FRAME = 7

    @staticmethod
    def is_audio_token(token: int) -> bool:
        return int(token) >= OrpheusAudioTokens.AUDIO_TOKEN_BASE

    @staticmethod
    def to_code(token: int, index: int) -> int:
        """The SNAC code of the ``index``-th audio token (may be out of range for bad tokens)."""
        c = OrpheusAudioTokens
        return int(token) - c.AUDIO_TOKEN_BASE - (index % c.TOKENS_PER_FRAME) * c.CODE_SIZE

    @staticmethod
    def to_token(code: int, index: int) -> int:
        """The token id the LLM emits for ``code`` as its ``index``-th audio token."""
        c = OrpheusAudioTokens
        return c.AUDIO_TOKEN_BASE + (index % c.TOKENS_PER_FRAME) * c.CODE_SIZE + int(code)


AUDIO_TOKEN_BASE = OrpheusAudioTokens.AUDIO_TOKEN_BASE
CODE_SIZE = OrpheusAudioTokens.CODE_SIZE
TOKENS_PER_FRAME = OrpheusAudioTokens.TOKENS_PER_FRAME
is_audio_token = OrpheusAudioTokens.is_audio_token
WINDOW_FRAMES = 4
WINDOW_TOKENS = WINDOW_FRAMES * TOKENS_PER_FRAME  # 28
# positions within a frame's 7 codes feeding SNAC levels 0, 1, 2 (in this order within a frame)
FRAME_LEVEL_POSITIONS: tuple[tuple[int, ...], ...] = ((0,), (1, 4), (2, 3, 5, 6))
_FRAME_OFFSETS = torch.arange(TOKENS_PER_FRAME, dtype=torch.long) * CODE_SIZE


def frame_codes(tokens: Sequence[int] | torch.Tensor, start_index: int) -> tuple[torch.Tensor, bool]:
    """[F, 7] codes of the whole frames of ``tokens`` and whether all are valid."""
    if start_index % TOKENS_PER_FRAME:
        raise ValueError(f"audio tokens must start at a frame boundary (a multiple of {TOKENS_PER_FRAME}), "
                         f"got start index {start_index}")
    t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    frames = t.numel() // TOKENS_PER_FRAME
    codes = t[: frames * TOKENS_PER_FRAME].view(frames, TOKENS_PER_FRAME) - AUDIO_TOKEN_BASE - _FRAME_OFFSETS
    valid = bool(((codes >= 0) & (codes < CODE_SIZE)).all())
    return codes, valid


def levels_frame_major(codes: torch.Tensor) -> list[torch.Tensor]:
    """[F, 7] frame codes -> per level [F, 1], [F, 2], [F, 4]."""
    return [codes[:, list(pos)] for pos in FRAME_LEVEL_POSITIONS]


def tokens_to_codes(tokens: Sequence[int] | torch.Tensor, start_index: int) -> tuple[list[torch.Tensor], bool]:
    """SNAC codes of the whole frames in ``tokens`` (a trailing partial frame is ignored).

    ``tokens[0]`` is the request's audio token number ``start_index``, which must be a multiple of
    7 (ValueError otherwise). Returns the three int64 code tensors ``[1, F]``, ``[1, 2F]``,
    ``[1, 4F]`` that ``snac.SNAC.decode`` takes, and whether every code is in ``[0, 4096)``
    (out-of-range codes are returned unchanged).
    """
    codes, valid = frame_codes(tokens, start_index)
    return [lvl.reshape(1, -1) for lvl in levels_frame_major(codes)], valid


@dataclass(frozen=True)
class ChunkPlan:
    """What one chunk decodes and emits: its first ``num_frames`` whole frames are decoded and the
    audio of frames ``[emit_from, emit_to)`` is emitted (no decode when ``num_frames == 0``)."""

    num_frames: int
    emit_from: int
    emit_to: int


def plan_chunk(num_items: int, start: int, new_start: int, is_final: bool) -> ChunkPlan:
    """The streaming rule of the module docstring for a chunk of ``num_items`` audio tokens."""
    if is_final and start == 0 and new_start == 0:  # rule 3: the whole (short) stream
        frames = num_items // TOKENS_PER_FRAME
        return ChunkPlan(frames, 0, frames)
    if num_items == WINDOW_TOKENS and start % TOKENS_PER_FRAME == 0:  # rule 1: a 4-frame window
        return ChunkPlan(WINDOW_FRAMES, 1, 2)
    if is_final:  # rule 2: trailing partial frame after the last window
        return ChunkPlan(0, 0, 0)
    raise ValueError(f"snac_decoder expects chunks of SlidingWindowChunkPolicy(window={WINDOW_TOKENS}, "
                     f"stride={TOKENS_PER_FRAME}); got {num_items} tokens from stream index {start} "
                     f"(new from {new_start})")


def to_pcm16(audio: torch.Tensor) -> torch.Tensor:
    """Float audio in [-1, 1] -> int16 PCM: ``round(clamp(audio, -1, 1) * 32767)``."""
    return (audio.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
