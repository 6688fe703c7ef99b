"""Request and response schemas (pydantic), so /openapi.json describes every route."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None


class AudioParams(BaseModel):
    voice: str | None = None
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI chat fields with no effect in mstar yet -> whether a value asks for something (their no-op
# values, e.g. ``logprobs: false`` or ``presence_penalty: 0``, are accepted: SDKs and tools send them)
_UNSUPPORTED_CHAT_FIELDS: dict[str, Any] = {
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
_UNSUPPORTED_FIELD_NAMES = tuple(_UNSUPPORTED_CHAT_FIELDS)


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
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: AudioParams | None = None
    ignore_eos: bool = False

    # OpenAI fields mstar does not implement yet (``_UNSUPPORTED_CHAT_FIELDS``): declared so that a value
    # asking for something is refused naming its field, never accepted with no effect
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator(*_UNSUPPORTED_FIELD_NAMES)
    @classmethod
    def _no_silent_gaps(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and _UNSUPPORTED_CHAT_FIELDS[info.field_name](value):
            raise ValueError(f"{info.field_name} is not supported yet (remove it, or send its no-op value)")
        return value


class ResponseAudio(BaseModel):
    id: str
    data: str
    expires_at: int
    transcript: str


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | list[dict[str, Any]] | None = None
    audio: ResponseAudio | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None


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
