"""Qwen3-Omni behind the OpenAI API: chat with text, image and audio in, text and speech out, and
``/v1/audio/speech`` through the same chat path.

Requests -> runtime inputs (what the model's walks read):

* ``input_ids``: ``[LongTensor[P]]``, the ChatML prompt (:func:`~mstar.models.qwen3_omni.prompt.chat_token_ids`)
  with one placeholder per audio / image token, media before the text of its user turn;
  :data:`~mstar.models.qwen3_omni.prompt.AUDIO_SYSTEM_PROMPT` as the system turn when speech is asked
  for and the request has no system message;
* ``audio_features``: one ``[128, T_i]`` float tensor per ``input_audio`` clip, in prompt order
  (only when there is audio input);
* ``pixel_values``: ``[FloatTensor[N, 1536]]``, the patches of every image, and ``image_grid_thw``:
  ``[LongTensor[I, 3]]`` (only when there are images).

Parameters (the model's contract, ``model.py``): ``sampling`` and ``max_tokens`` for the Thinker (the
OpenAI fields the request gives; the rest are the model's defaults) and, only when speech is asked
for (``modalities`` holds ``"audio"``, and always on ``/v1/audio/speech``): ``audio: True``,
``voice`` (lowercase; unknown voices are a 400 naming the choices), ``talker_sampling`` from the
request's ``talker_temperature`` / ``talker_top_k`` / ``talker_top_p`` /
``talker_repetition_penalty`` / ``talker_seed`` / ``talker_max_tokens`` extras (the request's
``seed`` when no ``talker_seed`` is given; ``talker_temperature=0`` is greedy, which makes the code
predictor greedy too) and ``code_predictor_sampling`` from ``code_predictor_*`` extras. Defaults
(Talker temperature 0.9, top-k 50, repetition penalty 1.05; code predictor top-k 50, top-p 0.8) are
the model's. Text-only requests carry no ``audio`` flag, so they never reach the Talker.

Emitted items -> API outputs: ``text`` (Thinker token ids) -> text deltas; ``audio`` (Code2Wav
chunks, float in [-1, 1] or int16) -> PCM16 chunks at 24 kHz.

The model object must provide ``tokenizer`` (``encode(text, add_special_tokens=False)``,
``decode(ids, skip_special_tokens=True)``) and ``parse_request(inputs, params)`` (the request parsed
once, an ``OmniRequest``: what the adapter submits); ``voices`` is used when present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.layers.vad import VadRequest
from mstar.model.adapter import (
    CHAT,
    GENERATE,
    SPEECH,
    ApiAdapter,
    ApiRequest,
    AudioChunk,
    ItemDecoder,
    TextDelta,
    TextStreamDecoder,
    stop_strings,
    text_sampling_params,
)
from mstar.models.qwen3_omni.code2wav import SAMPLE_RATE, to_pcm16
from mstar.models.qwen3_omni.encoders import AudioInput, ImageInput, audio_input, image_input
from mstar.models.qwen3_omni.prompt import (
    AUDIO_SYSTEM_PROMPT,
    AudioPart,
    ChatTurn,
    ImagePart,
    OmniTokenIds,
    chat_token_ids,
)
from mstar.models.qwen3_omni.request import OmniRequest

__all__ = ["SPEECH_PROMPT", "VOICES", "OmniDecoder", "Qwen3OmniAdapter"]

VOICES = ("chelsie", "ethan", "aiden")
DEFAULT_VOICE = "ethan"
MAX_PROMPT_TOKENS = 32768
MAX_INPUT_CHARS = 4000
# /v1/audio/speech: the text becomes this user message, so the answer the model speaks is the text
SPEECH_PROMPT = "Read the following text aloud exactly as written, without adding anything:\n{text}"
_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "seed")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class _Media:
    """A request's decoded media, consumed in prompt order."""

    images: list[ImageInput]
    audio: list[AudioInput]


def _text_and_media(content: Any, media: _Media, cursor: list[int]) -> tuple[str, tuple]:
    if content is None or isinstance(content, str):
        return content or "", ()
    text, parts = [], []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            text.append(part.get("text") or "")
        elif kind == "image_url":
            parts.append(ImagePart(media.images[cursor[0]].num_tokens))
            cursor[0] += 1
        elif kind == "input_audio":
            parts.append(AudioPart(media.audio[cursor[1]].num_tokens))
            cursor[1] += 1
    return "".join(text), tuple(parts)


def _turns(messages: Sequence[Mapping[str, Any]], media: _Media) -> list[ChatTurn]:
    turns, cursor = [], [0, 0]
    for message in messages:
        role = _ROLES.get(message.get("role"))
        if role is None:
            raise ValueError(f"role {message.get('role')!r} is not supported; use system, user or assistant")
        text, parts = _text_and_media(message.get("content"), media, cursor)
        if parts and role != "user":
            raise ValueError("image and audio inputs must be in user messages")
        turns.append(ChatTurn(role, text, parts))
    return turns


def _pick(body: Mapping[str, Any], names: Sequence[str], prefix: str = "") -> dict[str, Any]:
    return {n: body[prefix + n] for n in names if body.get(prefix + n) is not None}


class Qwen3OmniAdapter(ApiAdapter):
    routes = frozenset({CHAT, SPEECH, GENERATE})
    default_voice = DEFAULT_VOICE
    sample_rate = SAMPLE_RATE
    accepts_audio = True
    detects_speech = True  # the graph's VAD walk (mstar.layers.vad)

    def __init__(self, model: Any, token_ids: OmniTokenIds | None = None) -> None:
        self.model = model
        self.ids = token_ids or OmniTokenIds()
        self.voices = tuple(getattr(model, "voices", None) or VOICES)

    # -- requests ----------------------------------------------------------------------------------

    def chat_request(self, body, images, audio):
        settings, window = self.model.media, self.model.audio_window  # the checkpoint's preprocessing
        media = _Media(images=[image_input(p, settings.image) for p in images],
                       audio=[audio_input(p, r, window, settings.audio) for p, r in audio])
        speech = self._speech_params(body) if "audio" in (body.get("modalities") or ()) else None
        turns = _turns(body["messages"], media)
        return self._request(turns, media, body, speech)

    def vad_request(self, audio, state, context):
        return ApiRequest({"vad_audio": [audio], "vad_state": [state], "vad_context": [context]}, VadRequest())

    def prefill_request(self, body, images, audio):
        """The chat request as a one-token text answer; for a spoken answer's prompt (its system
        prompt included), one that keeps the Thinker's states at the audio clips (``keep_states``),
        which the spoken answer's Talker reads."""
        request = self.chat_request({**body, "max_tokens": 1}, images, audio)
        omni: OmniRequest = request.params
        if omni.audio:
            omni = dataclasses.replace(omni, audio=False, talker=None, predictor=None, keep_states=True)
        return dataclasses.replace(request, params=omni)

    def speech_request(self, body):
        text = body["input"]
        if len(text) > MAX_INPUT_CHARS:
            raise ValueError(f"input has {len(text)} characters; at most {MAX_INPUT_CHARS}")
        if body.get("speed", 1.0) != 1.0:
            raise ValueError("speed other than 1.0 is not supported by qwen3-omni")
        turns = [ChatTurn("user", SPEECH_PROMPT.format(text=text))]
        return self._request(turns, _Media([], []), body, self._speech_params(body))

    def _request(self, turns: list[ChatTurn], media: _Media, body: Mapping[str, Any],
                 speech: dict[str, Any] | None) -> ApiRequest:
        encode = lambda text: self.model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        system = AUDIO_SYSTEM_PROMPT if speech is not None else None
        ids = chat_token_ids(turns, encode, self.ids, system_prompt=system)
        if len(ids) > MAX_PROMPT_TOKENS:
            raise ValueError(f"the prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS}")
        inputs: dict[str, Any] = {"input_ids": [torch.tensor(ids, dtype=torch.long)]}
        if media.audio:
            inputs["audio_features"] = [a.features for a in media.audio]
        if media.images:
            inputs["pixel_values"] = [torch.cat([i.pixel_values for i in media.images])]
            inputs["image_grid_thw"] = [torch.stack([i.grid_thw for i in media.images])]
        params = {**self._thinker_params(body), **(speech or {})}
        request = self.model.parse_request(inputs, params)  # an OmniRequest: checked once, submitted as it is
        stop = stop_strings(body)
        if stop and speech is not None:  # the Talker speaks behind the text: a cut would end it mid-word
            raise ValueError("stop strings apply to text-only answers; not with modalities ['audio']")
        return ApiRequest(inputs, request, prompt_tokens=len(ids), stop=stop)

    def _thinker_params(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return text_sampling_params(body, {k: k for k in _SAMPLING})

    def _speech_params(self, body: Mapping[str, Any]) -> dict[str, Any]:
        audio = body.get("audio") or {}
        voice = audio.get("voice") or body.get("voice") or self.default_voice
        if not isinstance(voice, str) or voice.lower() not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; choose one of: {', '.join(self.voices)}")
        talker = _pick(body, (*_SAMPLING, "max_tokens"), prefix="talker_")
        if "seed" not in talker and body.get("seed") is not None:
            talker["seed"] = body["seed"]
        params: dict[str, Any] = {"audio": True, "voice": voice.lower(), "talker_sampling": talker}
        predictor = _pick(body, _SAMPLING, prefix="code_predictor_")
        if predictor:
            params["code_predictor_sampling"] = predictor
        return params

    # -- outputs -----------------------------------------------------------------------------------

    def new_decoder(self, route, request):
        stops = frozenset(request.params.thinker_stop_ids)  # an OmniRequest (parsed by ``_request``)
        return OmniDecoder(TextStreamDecoder(self.model.tokenizer, stops, request.stop), self.sample_rate)


class OmniDecoder(ItemDecoder):
    """``text`` items through the incremental detokenizer, ``audio`` items as PCM16 chunks."""

    def __init__(self, text: TextStreamDecoder, sample_rate: int) -> None:
        self.text = text
        self.sample_rate = sample_rate

    def end(self, reason):
        self.text.end(reason)

    @property
    def finish_reason(self) -> str:  # type: ignore[override]
        return self.text.finish_reason

    @property
    def done(self) -> bool:  # type: ignore[override]
        return self.text.done

    def feed(self, name: str, value: list[torch.Tensor]) -> list[TextDelta | AudioChunk]:
        if name == "text":
            return self.text.feed(name, value)
        if name != "audio":
            return []
        chunks = [v if v.dtype == torch.int16 else to_pcm16(v) for v in value]
        return [AudioChunk(c.reshape(-1).cpu(), self.sample_rate) for c in chunks if c.numel()]

    def finish(self) -> list[TextDelta | AudioChunk]:
        return self.text.finish()
