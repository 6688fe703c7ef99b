"""Orpheus behind /v1/audio/speech: text + voice -> prompt ids; streamed PCM16 -> audio chunks."""

from __future__ import annotations

import torch

from mstar.model.adapter import GENERATE, SPEECH, ApiAdapter, ApiRequest, AudioChunk, ItemDecoder
from mstar.models.orpheus.config import VOICES

# request fields (OpenAI's plus extra_body knobs) -> our sampling fields
_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "seed")
MAX_INPUT_CHARS = 4000


class OrpheusAdapter(ApiAdapter):
    routes = frozenset({SPEECH, GENERATE})
    voices = VOICES
    default_voice = "tara"

    def __init__(self, model) -> None:
        self.model = model
        self.sample_rate = 24000

    def speech_request(self, body):
        text = body["input"]
        if len(text) > MAX_INPUT_CHARS:
            raise ValueError(f"input has {len(text)} characters; at most {MAX_INPUT_CHARS}")
        if body.get("speed", 1.0) != 1.0:
            raise ValueError("speed other than 1.0 is not supported by orpheus")
        voice = body.get("voice") or self.default_voice
        ids = self.model.prompt_ids(text, voice)
        sampling = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
        params = {"sampling": sampling}
        if body.get("max_tokens") is not None:
            params["max_tokens"] = int(body["max_tokens"])
        inputs = {"input_ids": [torch.tensor(ids, dtype=torch.long)]}
        return ApiRequest(inputs, self.model.parse_request(inputs, params), prompt_tokens=len(ids))

    def new_decoder(self, route, request):
        return _AudioDecoder(self.sample_rate)


class _AudioDecoder(ItemDecoder):
    def __init__(self, rate: int) -> None:
        self.rate = rate

    def feed(self, name, value):
        if name != "audio":
            return []
        return [AudioChunk(v, self.rate) for v in value if v.numel()]
