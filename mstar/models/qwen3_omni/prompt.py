"""Qwen3-Omni prompts: the chat prompt the Thinker reads and the prompt the Talker is prefilled with.

Talker prompt (transformers' ``_get_talker_user_parts`` / ``_get_talker_assistant_parts``), for one
request whose Thinker prompt is ``prompt_ids`` (``P`` tokens ending in ``<|im_start|>assistant\\n``):

* user part: every prompt position whose enclosing turn (the role token after the latest
  ``<|im_start|>``) is ``user``, in order: ``hidden_projection(thinker_hidden)`` at audio / image /
  video placeholder positions, ``text_projection(thinker_embed)`` elsewhere (the system turn and
  earlier assistant turns are left out);
* assistant prefix, 9 positions from the last ``<|im_start|>assistant``: text part
  ``[P(im_start), P(assistant), P(\\n), tts_pad x4, tts_bos, P(first generated token)]`` plus codec
  part ``[0, 0, 0, E(nothink), E(think_bos), E(think_eos), E(speaker), E(codec_pad), E(codec_bos)]``;
* the ids for positions: user ids then 9 x ``tts_pad``;
* trailing text: ``P(generated token k + 1)`` is added to the Talker's input at decode step ``k``;
  after the last text token ``tts_eos``, then ``tts_pad`` for ever (:func:`trailing_text`).

``P`` is the Talker's ``text_projection`` of the Thinker's input embeddings (layer 0), ``E`` the
Talker's codec embedding, ``tts_*`` the text projection of those tokens' Thinker embeddings
(:func:`tts_embeds`). Projections and embeddings are supplied as callables, so this module holds no
weights. ``thinker_embed`` needs rows ``0..P`` (the prompt and the first generated token),
``thinker_hidden`` rows ``0..P-1`` (the ``accept_hidden_layer`` output of the prompt).

Chat prompt (:func:`chat_token_ids`): ChatML with special tokens inserted by id, media placeholders
inside the user turn before its text, and :data:`AUDIO_SYSTEM_PROMPT` as the system turn when audio
is generated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mstar.models.qwen3_omni.config import OmniTokenIds

__all__ = [
    "AUDIO_SYSTEM_PROMPT",
    "AudioPart",
    "ChatTurn",
    "ImagePart",
    "OmniTokenIds",
    "TalkerPrompt",
    "TtsEmbeds",
    "assistant_start",
    "build_talker_prompt",
    "chat_token_ids",
    "multimodal_mask",
    "trailing_text",
    "tts_embeds",
    "user_positions",
]

AUDIO_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)
Projection = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TtsEmbeds:
    """Text projections of ``tts_bos``, ``tts_eos``, ``tts_pad`` (each ``[H]``, Talker width)."""

    bos: torch.Tensor
    eos: torch.Tensor
    pad: torch.Tensor


@dataclass(frozen=True)
class TalkerPrompt:
    """The Talker's prefill: ``embeds`` ``[U + 9, H]``, ``input_ids`` ``[U + 9]`` (what its RoPE
    positions are computed from) and ``user_positions`` ``[U]`` (their indices in the Thinker prompt)."""

    embeds: torch.Tensor
    input_ids: torch.Tensor
    user_positions: torch.Tensor


def _as_ids(prompt_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids


def user_positions(prompt_ids: Sequence[int] | torch.Tensor, ids: OmniTokenIds) -> torch.Tensor:
    """Indices of the prompt positions inside user turns (role token after the latest ``<|im_start|>``;
    positions before any ``<|im_start|>`` take the role after position 0, as the reference does)."""
    tokens = _as_ids(prompt_ids)
    n = tokens.numel()
    pos = torch.arange(n)
    starts = torch.where(tokens == ids.im_start, pos, torch.full_like(pos, -1))
    latest = torch.cummax(starts, dim=0).values.clamp_min(0)
    roles = tokens[(latest + 1).clamp_max(n - 1)]
    return pos[roles == ids.user]


def multimodal_mask(prompt_ids: Sequence[int] | torch.Tensor, ids: OmniTokenIds) -> torch.Tensor:
    """True at audio / image / video placeholder positions."""
    tokens = _as_ids(prompt_ids)
    return (tokens == ids.audio) | (tokens == ids.image) | (tokens == ids.video)


def assistant_start(prompt_ids: Sequence[int] | torch.Tensor, ids: OmniTokenIds) -> int:
    """Index of the last ``<|im_start|>assistant`` pair; ``ValueError`` if there is none."""
    tokens = _as_ids(prompt_ids)
    hits = ((tokens[:-1] == ids.im_start) & (tokens[1:] == ids.assistant)).nonzero().flatten()
    if hits.numel() == 0:
        raise ValueError("the prompt has no '<|im_start|>assistant' turn for the Talker to speak")
    return int(hits[-1])


def tts_embeds(embed_tokens: Projection, text_projection: Projection, ids: OmniTokenIds) -> TtsEmbeds:
    """Project the Thinker embeddings of ``tts_bos``, ``tts_eos``, ``tts_pad`` (one batched call)."""
    special = torch.tensor([[ids.tts_bos, ids.tts_eos, ids.tts_pad]])
    bos, eos, pad = text_projection(embed_tokens(special))[0].unbind(0)
    return TtsEmbeds(bos=bos, eos=eos, pad=pad)


def _user_part(prompt: torch.Tensor, thinker_embed: torch.Tensor, thinker_hidden: torch.Tensor,
               text_projection: Projection, hidden_projection: Projection,
               ids: OmniTokenIds) -> tuple[torch.Tensor, torch.Tensor]:
    n = prompt.numel()
    mm = multimodal_mask(prompt, ids)
    # every text position of the prompt is projected in one call (as the reference), then gathered
    text = text_projection(thinker_embed[:n][~mm])
    part = text.new_empty(n, text.shape[-1])
    part[~mm] = text
    if bool(mm.any()):
        part[mm] = hidden_projection(thinker_hidden[:n][mm]).to(part.dtype)
    users = user_positions(prompt, ids)
    return part[users], users


def _assistant_prefix(assistant: torch.Tensor, speaker: int, tts: TtsEmbeds,
                      codec_embedding: Projection, ids: OmniTokenIds) -> torch.Tensor:
    """``assistant`` ``[4, H]``: projected im_start, assistant, newline, first generated token."""
    text = torch.cat([assistant[:3], tts.pad.expand(4, -1), tts.bos[None], assistant[3:4]])
    codec_ids = torch.tensor([ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, speaker,
                              ids.codec_pad, ids.codec_bos])
    codec = codec_embedding(codec_ids).to(text.dtype)
    return text + torch.cat([codec.new_zeros(3, codec.shape[-1]), codec])


def build_talker_prompt(prompt_ids: Sequence[int] | torch.Tensor, thinker_embed: torch.Tensor,
                        thinker_hidden: torch.Tensor, *, speaker: int, tts: TtsEmbeds,
                        text_projection: Projection, hidden_projection: Projection,
                        codec_embedding: Projection, ids: OmniTokenIds) -> TalkerPrompt:
    """The Talker prefill of one request (see the module docstring). ``thinker_embed`` ``[>= P + 1,
    Ht]``: the Thinker's input embeddings of the prompt and its first generated token;
    ``thinker_hidden`` ``[>= P, Ht]``: the accepted layer's output on the prompt."""
    prompt = _as_ids(prompt_ids)
    n = prompt.numel()
    if thinker_embed.shape[0] < n + 1 or thinker_hidden.shape[0] < n:
        raise ValueError(f"the Talker prompt needs {n + 1} Thinker embeddings and {n} hidden states, got "
                         f"{thinker_embed.shape[0]} and {thinker_hidden.shape[0]}")
    start = assistant_start(prompt, ids)
    if n - start != 3:
        raise ValueError("the prompt must end with '<|im_start|>assistant\\n' (3 tokens after the last turn start)")
    user, users = _user_part(prompt, thinker_embed, thinker_hidden, text_projection, hidden_projection, ids)
    assistant = text_projection(thinker_embed[start:n + 1])
    prefix = _assistant_prefix(assistant, speaker, tts, codec_embedding, ids)
    embeds = torch.cat([user, prefix.to(user.dtype)])
    input_ids = torch.cat([prompt[users], torch.full((9,), ids.tts_pad, dtype=torch.long)])
    return TalkerPrompt(embeds=embeds, input_ids=input_ids, user_positions=users)


def trailing_text(generated_embeds: torch.Tensor, text_projection: Projection, tts: TtsEmbeds) -> torch.Tensor:
    """The text added at each Talker decode step for a finished answer: ``P(g_1 .. g_{T-1})`` then
    ``tts_eos`` (``generated_embeds`` ``[T - 1, Ht]``: the Thinker embeddings of the generated text
    tokens after the first, the stop token excluded). Later steps add ``tts.pad``."""
    projected = text_projection(generated_embeds) if generated_embeds.shape[0] else tts.eos.new_zeros(0, tts.eos.shape[-1])
    return torch.cat([projected, tts.eos[None]])


# ---------------------------------------------------------------------------------------------------
# The Thinker's chat prompt
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioPart:
    """An audio input: ``num_tokens`` placeholders (the audio tower's output length)."""

    num_tokens: int


@dataclass(frozen=True)
class ImagePart:
    """An image input: ``num_tokens`` placeholders (patches after the spatial merge)."""

    num_tokens: int


@dataclass(frozen=True)
class ChatTurn:
    """One message: ``role`` (system / user / assistant), its media parts and its text."""

    role: str
    text: str = ""
    media: tuple[AudioPart | ImagePart, ...] = ()


def _media_ids(part: AudioPart | ImagePart, ids: OmniTokenIds) -> list[int]:
    if isinstance(part, AudioPart):
        return [ids.audio_start] + [ids.audio] * part.num_tokens + [ids.audio_end]
    return [ids.vision_start] + [ids.image] * part.num_tokens + [ids.vision_end]


def chat_token_ids(turns: Sequence[ChatTurn], encode: Callable[[str], list[int]], ids: OmniTokenIds,
                   *, system_prompt: str | None = None) -> list[int]:
    """``<|im_start|>{role}\\n{media}{text}<|im_end|>\\n`` per turn, then ``<|im_start|>assistant\\n``.
    ``system_prompt`` (e.g. :data:`AUDIO_SYSTEM_PROMPT`) is prepended as a system turn unless the
    turns start with one. ``encode`` turns plain text into ids (no special tokens)."""
    roles = {"system": ids.system, "user": ids.user, "assistant": ids.assistant}
    if system_prompt is not None and (not turns or turns[0].role != "system"):
        turns = [ChatTurn("system", system_prompt), *turns]
    out: list[int] = []
    for turn in turns:
        if turn.role not in roles:
            raise ValueError(f"unknown role {turn.role!r}; use system, user or assistant")
        out += [ids.im_start, roles[turn.role], ids.newline]
        for part in turn.media:
            out += _media_ids(part, ids)
        out += list(encode(turn.text)) + [ids.im_end, ids.newline]
    return out + [ids.im_start, ids.assistant, ids.newline]
