"""Request and response schemas (pydantic), so /openapi.json describes every route."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI SDK extras (extra_body) arrive as top-level keys


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


class ChatCompletionRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio", "image"]] | None = None
    audio: AudioParams | None = None
    ignore_eos: bool = False


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
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] | None = None


class ImageRequest(_Open):
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=4)
    size: str = "256x256"
    response_format: Literal["b64_json"] = "b64_json"


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class GenerateRequest(BaseModel):
    inputs: dict[str, Any] = Field(description="input name -> tensor: {dtype, shape, data (base64)} or JSON numbers")
    params: dict[str, Any] = Field(default_factory=dict)


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
