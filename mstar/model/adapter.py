"""How a model meets the HTTP API: requests -> its inputs, emitted items -> API outputs.

Each family declares an ``ApiAdapter`` in its own folder (``ModelDef.api_adapter()``); the server
stays model-agnostic. Adapters see plain dicts (the parsed JSON body of a route) and return tensors
and parameters for the runtime; they raise ``ValueError`` for bad input (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

CHAT = "chat"  # POST /v1/chat/completions
SPEECH = "speech"  # POST /v1/audio/speech (+ GET /v1/audio/voices)
IMAGES = "images"  # POST /v1/images/generations
IMAGE_EDITS = "image_edits"  # POST /v1/images/edits
GENERATE = "generate"  # POST /generate (every model)
POLICY = "policy"  # websocket at "/": openpi's policy protocol (msgpack-numpy observations in, actions out)

ROUTE_PATHS = {
    CHAT: "/v1/chat/completions",
    SPEECH: "/v1/audio/speech",
    IMAGES: "/v1/images/generations",
    IMAGE_EDITS: "/v1/images/edits",
    GENERATE: "/generate",
    POLICY: "/",
}


def text_sampling_params(body: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """A text model's runtime params from an OpenAI request body: ``{"sampling": ..., "max_tokens":
    ...}`` with the body's ``fields`` (OpenAI name -> SamplingParams name) that are set, its
    ``stop_token_ids``, and ``max_completion_tokens`` (else ``max_tokens``). ``stop`` strings are
    refused (ValueError)."""
    if body.get("stop"):
        raise ValueError("'stop' strings are not supported; use stop_token_ids")
    sampling = {ours: body[theirs] for theirs, ours in fields.items() if body.get(theirs) is not None}
    if body.get("stop_token_ids"):
        sampling["stop_token_ids"] = list(body["stop_token_ids"])
    params: dict[str, Any] = {"sampling": sampling}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        params["max_tokens"] = int(max_tokens)
    return params


@dataclass(frozen=True)
class TextDelta:
    text: str
    num_tokens: int = 1


@dataclass(frozen=True)
class AudioChunk:
    pcm: torch.Tensor  # int16 mono samples
    sample_rate: int


@dataclass(frozen=True)
class ImageOut:
    pixels: torch.Tensor  # uint8 [H, W, 3]


@dataclass(frozen=True)
class ApiRequest:
    """What a route hands the runtime: inputs, parameters and per-request decoding state."""

    inputs: dict[str, Any]
    params: dict[str, Any]
    prompt_tokens: int = 0


class ApiAdapter:
    """Base adapter: only the native ``/generate`` route."""

    routes: frozenset[str] = frozenset({GENERATE})
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    sample_rate: int = 24000

    def chat_request(self, body: Mapping[str, Any], images: list[torch.Tensor],
                     audio: list[tuple[torch.Tensor, int]]) -> ApiRequest:
        """``body``: the chat completion request; ``images`` decoded (uint8 HWC), ``audio`` (pcm, rate)."""
        raise NotImplementedError

    def speech_request(self, body: Mapping[str, Any]) -> ApiRequest:
        raise NotImplementedError

    def image_request(self, body: Mapping[str, Any], image: torch.Tensor | None) -> ApiRequest:
        raise NotImplementedError

    def new_decoder(self, route: str, request: ApiRequest) -> ItemDecoder:
        """A per-request object turning streamed items into API outputs."""
        raise NotImplementedError

    def generate_request(self, inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> ApiRequest:
        """``/generate``'s tensors and parameters -> the runtime's; default: passed on unchanged."""
        return ApiRequest(inputs, params)

    def generate_outputs(self, request: ApiRequest, name: str, value: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors ``/generate`` sends for one emitted item; default: the item's own."""
        return value

    def policy_metadata(self) -> dict[str, Any]:
        """The policy route's first frame (plain msgpack-able values)."""
        raise NotImplementedError

    def policy_request(self, observation: Mapping[str, Any]) -> ApiRequest:
        """One decoded observation (numpy arrays, strings, numbers) -> the runtime's inputs."""
        raise NotImplementedError

    def policy_reply(self, request: ApiRequest, outputs: Mapping[str, list[torch.Tensor]]) -> dict[str, Any]:
        """The request's emitted items by name -> the reply (numpy arrays, plain values)."""
        raise NotImplementedError


class ItemDecoder:
    """Turns one request's emitted items into API outputs (stateful: e.g. incremental detokenizing).
    ``finish_reason`` is reported to the client when the request ends ("stop" or "length")."""

    finish_reason: str = "stop"

    def feed(self, name: str, value: list[torch.Tensor]) -> list[TextDelta | AudioChunk | ImageOut]:
        raise NotImplementedError

    def finish(self) -> list[TextDelta | AudioChunk | ImageOut]:
        return []


class TextStreamDecoder(ItemDecoder):
    """Incremental detokenizing: decode all ids so far, emit what was added; hold back a trailing
    replacement character (an incomplete UTF-8 sequence) until the next token completes it."""

    def __init__(self, tokenizer, max_tokens: int, stop_ids: set[int]) -> None:
        self.tok, self.max_tokens, self.stop_ids = tokenizer, max_tokens, stop_ids
        self.ids: list[int] = []
        self.sent = ""

    def feed(self, name, value):
        token = int(value[0].reshape(-1)[0])
        self.ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return [TextDelta("", 1)]
        if len(self.ids) >= self.max_tokens:
            self.finish_reason = "length"
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return [TextDelta("", 1)]
        delta, self.sent = text[len(self.sent):], text
        return [TextDelta(delta, 1)]

    def finish(self):
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        rest = text[len(self.sent):]
        self.sent = text
        return [TextDelta(rest, 0)] if rest else []
