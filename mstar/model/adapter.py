"""How a model meets the HTTP API: requests -> its inputs, emitted items -> API outputs.

Each family declares an ``ApiAdapter`` in its own folder (``ModelDef.api_adapter()``); the server
stays model-agnostic. Adapters see plain dicts (the parsed JSON body of a route) and return tensors
and parameters for the runtime; they raise ``ValueError`` for bad input (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mstar.graph.finish import FinishReason

CHAT = "chat"  # POST /v1/chat/completions
COMPLETIONS = "completions"  # POST /v1/completions
SPEECH = "speech"  # POST /v1/audio/speech (+ GET /v1/audio/voices)
IMAGES = "images"  # POST /v1/images/generations
IMAGE_EDITS = "image_edits"  # POST /v1/images/edits
GENERATE = "generate"  # POST /generate (every model)
POLICY = "policy"  # websocket at "/": openpi's policy protocol (msgpack-numpy observations in, actions out)

ROUTE_PATHS = {
    CHAT: "/v1/chat/completions",
    COMPLETIONS: "/v1/completions",
    SPEECH: "/v1/audio/speech",
    IMAGES: "/v1/images/generations",
    IMAGE_EDITS: "/v1/images/edits",
    GENERATE: "/generate",
    POLICY: "/",
}


MAX_STOP_STRINGS, MAX_STOP_CHARS = 4, 256  # OpenAI's count; a bound on each string's search


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The request's ``stop``: a string or a list of up to ``MAX_STOP_STRINGS`` non-empty strings of at
    most ``MAX_STOP_CHARS`` characters (ValueError naming ``stop`` otherwise); () when absent."""
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not 1 <= len(items) <= MAX_STOP_STRINGS or not all(
            isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in items):
        raise ValueError(f"stop must be a string or a list of 1-{MAX_STOP_STRINGS} non-empty strings of at most "
                         f"{MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(items))


def text_sampling_params(body: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """A text model's runtime params from an OpenAI request body: ``{"sampling": ..., "max_tokens":
    ...}`` with the body's ``fields`` (OpenAI name -> SamplingParams name) that are set, its
    ``stop_token_ids``, and ``max_completion_tokens`` (else ``max_tokens``). ``stop`` strings are the
    decoder's (``stop_strings``, ``TextStreamDecoder``), not the runtime's."""
    stop_strings(body)  # a bad ``stop`` is a 400 before anything runs
    sampling = {ours: body[theirs] for theirs, ours in fields.items() if body.get(theirs) is not None}
    if body.get("stop_token_ids"):
        sampling["stop_token_ids"] = list(body["stop_token_ids"])
    params: dict[str, Any] = {"sampling": sampling}
    newer, older = body.get("max_completion_tokens"), body.get("max_tokens")  # both read: clients send both
    max_tokens = newer or older
    if max_tokens is not None:
        params["max_tokens"] = int(max_tokens)
    return params


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability as OpenAI reports it: its text, the text's UTF-8 bytes, and (for
    the sampled token) the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[TokenLogprob, ...] = ()

    def to_openai(self) -> dict[str, Any]:
        entry = {"token": self.token, "logprob": self.logprob, "bytes": list(self.token.encode("utf-8"))}
        return {**entry, "top_logprobs": [t.to_openai_alternative() for t in self.top]}

    def to_openai_alternative(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.token.encode("utf-8"))}


@dataclass(frozen=True)
class TextDelta:
    text: str
    num_tokens: int = 1
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens this delta covers, when the request asked


@dataclass(frozen=True)
class ToolCall:
    """One function call of an answer: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallsOut:
    """The answer is these function calls (``message.tool_calls``; finish_reason "tool_calls")."""

    calls: tuple[ToolCall, ...]


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
    params: Any  # the params dict, or the family's request already parsed (``ModelDef.parse_request``)
    prompt_tokens: int = 0
    stop: tuple[str, ...] = ()  # text that ends the answer (``stop_strings``): the decoder's, not the runtime's
    echo: str = ""  # the prompt's text, sent before the answer (``/v1/completions`` with ``echo``)
    # the answer may be function calls: "forced" (it is one, constrained), "auto" (the model may write
    # some), None (no tools); the decoder parses them
    tool_mode: Literal["forced", "auto"] | None = None
    parallel_tool_calls: bool = True  # False: at most the first call of an "auto" answer


LOGPROBS_OUTPUT = "logprobs"  # the emitted item of a step's log probabilities (``[ids, logprobs]``)


class ApiAdapter:
    """Base adapter: only the native ``/generate`` route."""

    routes: frozenset[str] = frozenset({GENERATE})
    # the optional OpenAI chat fields this model reads (``mstar.server.protocol.CHAT_OPTIONS``); the
    # chat route refuses the others with a 400 naming the field
    chat_options: frozenset[str] = frozenset()
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    sample_rate: int = 24000
    detects_speech: bool = False  # the graph has the VAD walk (``vad_request``): the realtime route's server VAD
    accepts_audio: bool = False  # chat_request takes ``input_audio`` parts (the realtime route's spoken turns)

    def chat_request(self, body: Mapping[str, Any], images: list[torch.Tensor],
                     audio: list[tuple[torch.Tensor, int]]) -> ApiRequest:
        """``body``: the chat completion request; ``images`` decoded (uint8 HWC), ``audio`` (pcm, rate)."""
        raise NotImplementedError

    def vad_request(self, audio: torch.Tensor, state: torch.Tensor, context: torch.Tensor) -> ApiRequest:
        """Voice activity detection over ``audio`` (whole windows at 8 kHz) from ``state`` / ``context``:
        the request of the model's VAD walk (``mstar.layers.vad``), where ``detects_speech``."""
        raise NotImplementedError(f"{type(self).__name__} has no VAD walk")

    def prefill_request(self, body: Mapping[str, Any], images: list[torch.Tensor],
                        audio: list[tuple[torch.Tensor, int]]) -> ApiRequest | None:
        """A request that computes the prompt of ``chat_request(body, images, audio)`` into the prefix
        cache, with whatever a later answer to a prompt starting the same reads there, and answers one
        token: the realtime route sends one each time a clip of a turn still being spoken is complete.
        The default: a text answer's chat request with ``max_tokens`` 1; None for a spoken answer (a
        family that speaks says what its answer needs kept)."""
        if "audio" in (body.get("modalities") or ()):
            return None
        return self.chat_request({**body, "max_tokens": 1}, images, audio)

    def completion_request(self, body: Mapping[str, Any], prompt: str | list[int]) -> ApiRequest:
        """One prompt of a ``/v1/completions`` body (its text, or its token ids)."""
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

    When the runtime's request ends, the route calls ``end`` with its ``FinishReason`` (the model
    decided it: ``mstar.model.decode``); ``finish_reason`` is then the word the client gets ("stop",
    "length"). ``done`` set by ``feed`` ends the request there (a stop string was produced): the
    route reads no more items, the runtime request is cancelled and the answer's reason is "stop"."""

    reason: FinishReason | None = None  # the runtime's, once the request ended
    done: bool = False

    def end(self, reason: FinishReason) -> None:
        self.reason = reason

    @property
    def finish_reason(self) -> str:
        if self.done or self.reason is None:
            return FinishReason.STOP.value
        return self.reason.value

    def feed(self, name: str, value: list[torch.Tensor]) -> list[TextDelta | AudioChunk | ImageOut | ToolCallsOut]:
        raise NotImplementedError

    def finish(self) -> list[TextDelta | AudioChunk | ImageOut | ToolCallsOut]:
        return []


class TextStreamDecoder(ItemDecoder):
    """Incremental detokenizing: decode all ids so far, emit what was added; hold back a trailing
    replacement character (an incomplete UTF-8 sequence) until the next token completes it.

    ``stop_ids``: the tokens that end generation (the model's stop flag decides that; they are only
    not shown here). ``stop``: strings that end the answer, matched on the decoded text (so across
    token boundaries). The text is cut before the first one and ``done`` is set; while
    streaming, a tail of the text that could still grow into a stop string is held back, so no part
    of one is ever sent.

    ``logprobs``: the request asked for them; each token's delta then waits for the ``logprobs`` item
    of its step (emitted after the token) and carries it as ``TokenLogprob``."""

    def __init__(self, tokenizer, stop_ids: set[int] | frozenset[int], stop: tuple[str, ...] = (),
                 logprobs: bool = False) -> None:
        self.tok, self.stop_ids, self.stop = tokenizer, stop_ids, stop
        self.logprobs = logprobs
        self.ids: list[int] = []
        self.sent = ""
        self._pending: TextDelta | None = None  # a token's delta waiting for its logprobs

    def feed(self, name, value):
        if self.done:
            return []
        if name == LOGPROBS_OUTPUT:
            return self._with_logprobs(value)
        out = self._token(value)
        if self.logprobs and not self.done:
            self._pending = out[0]
            return []
        return out

    def _with_logprobs(self, value: list[torch.Tensor]) -> list[TextDelta]:
        ids, lps = value[0].reshape(-1).tolist(), value[1].reshape(-1).tolist()
        top = tuple(TokenLogprob(self.tok.decode([i]), lp) for i, lp in zip(ids[1:], lps[1:]))
        entry = TokenLogprob(self.tok.decode([ids[0]]), lps[0], top)
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        return [TextDelta(pending.text, pending.num_tokens, (entry,))]

    def _token(self, value: list[torch.Tensor]) -> list[TextDelta]:
        token = int(value[0].reshape(-1)[0])
        self.ids.append(token)
        if token in self.stop_ids:  # counted, not shown
            return [TextDelta("", 1)]
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return [TextDelta("", 1)]
        if self.stop:
            return [TextDelta(self._until_stop(text), 1)]
        delta, self.sent = text[len(self.sent):], text
        return [TextDelta(delta, 1)]

    def _until_stop(self, text: str) -> str:
        """The new text that may be sent: up to the first stop string (then done), else all but a tail
        that is the start of a stop string."""
        start = max(0, len(self.sent) - max(len(s) for s in self.stop) + 1)  # a match may begin in sent text
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            self.done = True
            delta, self.sent = text[len(self.sent):cut], text[:max(cut, len(self.sent))]
            return delta
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        safe = max(len(self.sent), len(text) - hold)
        delta, self.sent = text[len(self.sent):safe], text[:safe]
        return delta

    def finish(self):
        pending, self._pending = self._pending, None
        held = [pending] if pending is not None else []
        if self.done:
            return held
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        rest = text[len(self.sent):]
        self.sent = text
        return held + ([TextDelta(rest, 0)] if rest else [])
