"""Request and response schemas (pydantic), so /openapi.json describes every route."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Every number a request carries is bounded: the runtime's wire format holds 64-bit ints, and no
# model has a use for a non-finite float or a context of more than MAX_TOKENS.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOKENS = 1 << 24
_MAX_DEPTH = 16

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


def _finite(**bounds: float) -> Any:
    return Field(default=None, allow_inf_nan=False, **bounds)


def check_json_value(value: Any, where: str, depth: int = 0) -> None:
    """``ValueError`` unless ``value`` is JSON whose ints fit 64 bits, floats are finite and nesting is
    at most ``_MAX_DEPTH`` deep: the checks for values a route passes on unparsed (extras, params)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{where}: integer {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} is not a finite number")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json_value(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_json_value(v, f"{where}[{i}]", depth + 1)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI SDK extras (extra_body) arrive as top-level keys

    @model_validator(mode="after")
    def _bounded_extras(self):
        for k, v in (self.model_extra or {}).items():
            check_json_value(v, k)
        return self


class ImageURL(BaseModel):
    url: str


class InputAudio(BaseModel):
    data: str
    format: Literal["wav"] = "wav"


class ContentPart(BaseModel):
    type: Literal["text", "image_url", "input_audio"]
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64)
    arguments: str


class MessageToolCall(BaseModel):
    """A function call an earlier assistant turn made (sent back with its result)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = Field(default=None, max_length=128)  # a tool turn: the call it answers


class AudioParams(BaseModel):
    voice: str | None = None
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI chat fields that only some models implement -> whether a value asks for something (their
# no-op values, e.g. ``logprobs: false`` or ``presence_penalty: 0``, are accepted from every model:
# SDKs and tools send them). A model's adapter lists those it reads (``ApiAdapter.chat_options``); the
# chat route refuses the others with a 400 naming the field (``refused_chat_option``), never ignoring one.
CHAT_OPTIONS: dict[str, Any] = {
    "n": lambda v: v != 1,
    "logprobs": lambda v: v is not False,
    "top_logprobs": lambda v: v != 0,
    "presence_penalty": lambda v: v != 0,
    "frequency_penalty": lambda v: v != 0,
    "logit_bias": lambda v: v != {},
    "response_format": lambda v: not (isinstance(v, dict) and v.get("type") == "text" and len(v) == 1),
    "tools": lambda v: v != [],
    "tool_choice": lambda v: v != "none",
    "functions": lambda v: v != [],
    "function_call": lambda v: v != "none",
    "prediction": lambda _v: True,
    "web_search_options": lambda _v: True,
}


def refused_chat_option(body: dict[str, Any], supported: frozenset[str]) -> str | None:
    """The first field of ``CHAT_OPTIONS`` in ``body`` that asks for something outside ``supported``."""
    for name, asks in CHAT_OPTIONS.items():
        value = dict.get(body, name)  # the route's look: not a read of the model's (``ReadDict``)
        if value is not None and name not in supported and asks(value):
            return name
    return None


MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 8  # ``n``: the choices of one request, each its own runtime request over the shared prompt


class ChatCompletionRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: float | None = _finite(ge=0, le=2)
    top_p: float | None = _finite(gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    repetition_penalty: float | None = _finite(gt=0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: AudioParams | None = None
    ignore_eos: bool = False

    # ``CHAT_OPTIONS``: read by the models that list them, refused by the others
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float | None = _finite(ge=-2, le=2)
    frequency_penalty: float | None = _finite(ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
    parallel_tool_calls: bool | None = None  # read with tools: False keeps an answer's first call only

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_Open):
    """``POST /v1/completions`` (OpenAI's legacy text completions, as vLLM serves them)."""

    model: str
    prompt: Prompt
    max_tokens: Tokens | None = 16  # OpenAI's default
    max_completion_tokens: Tokens | None = None  # takes precedence over max_tokens (guidellm sends both)
    temperature: float | None = _finite(ge=0, le=2)
    top_p: float | None = _finite(gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    repetition_penalty: float | None = _finite(gt=0)
    presence_penalty: float | None = _finite(ge=-2, le=2)
    frequency_penalty: float | None = _finite(ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None  # only its no-op value (None or n): ranking candidates is not implemented
    echo: bool = False
    suffix: str | None = None  # only its no-op value (None or ""): insertion is not implemented
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _no_silent_gaps(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (send n instead)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (the prompt's log probabilities are not computed)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class ResponseInputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class ResponseInputMessage(BaseModel):
    """One message of a ``/v1/responses`` input (other item kinds, e.g. images or tool output, are refused)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponseInputText]


class ResponseTextFormat(BaseModel):
    type: Literal["text"]


class ResponseTextConfig(BaseModel):
    format: ResponseTextFormat | None = None  # json output is the structured-output issue's


class ResponsesRequest(_Open):
    """``POST /v1/responses`` for text: what it reads; a field asking for something else (tools,
    reasoning, images) is a 400 naming it."""

    model: str
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: Tokens | None = None
    temperature: float | None = _finite(ge=0, le=2)
    top_p: float | None = _finite(gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=128)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    text: ResponseTextConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    tools: list[Any] | None = Field(default=None, max_length=0)  # only the no-op value: no tools
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None  # no tools: nothing to run in parallel
    truncation: Literal["disabled"] | None = None
    user: str | None = Field(default=None, max_length=256)  # echoed in the response
    reasoning: None = None  # refused: no reasoning model served
    background: Literal[False] | None = None


class ResponseAudio(BaseModel):
    id: str
    data: str
    expires_at: int
    transcript: str


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | list[dict[str, Any]] | None = None
    audio: ResponseAudio | None = None
    tool_calls: list[MessageToolCall] | None = None


class ChoiceLogprobs(BaseModel):
    content: list[dict[str, Any]] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class SpeechRequest(_Open):
    model: str
    input: str = Field(min_length=1)
    voice: str | None = None
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0, allow_inf_nan=False)
    stream_format: Literal["audio", "sse"] | None = None
    max_tokens: Tokens | None = None  # extras every speech model reads the same way
    temperature: float | None = _finite(ge=0, le=2)
    top_p: float | None = _finite(gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    repetition_penalty: float | None = _finite(gt=0)
    seed: Seed | None = None


class ImageRequest(_Open):
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=4)
    size: str = Field(default="256x256", max_length=32)
    response_format: Literal["b64_json"] = "b64_json"
    seed: Seed | None = None


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class SamplingFields(_Open):
    """The sampling parameters of ``/generate``'s ``params.sampling``, range-checked (unknown keys are
    passed on: the model names the valid ones)."""

    temperature: float | None = _finite(ge=0)
    top_p: float | None = _finite(gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    repetition_penalty: float | None = _finite(gt=0)
    seed: Seed | None = None
    max_tokens: Tokens | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None


class GenerateParams(_Open):
    max_tokens: Tokens | None = None
    sampling: SamplingFields | None = None


class GenerateRequest(BaseModel):
    inputs: dict[str, Any] = Field(description="input name -> tensor: {dtype, shape, data (base64)} or JSON numbers")
    params: GenerateParams = Field(default_factory=GenerateParams)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mstar"
    routes: list[str] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Voices(BaseModel):
    voices: list[str]
