"""What the sync and async clients share: request bodies, response parsing, stream framing (SSE,
NDJSON), tensors as JSON, and the typed error. No I/O here: each client only moves bytes."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatDelta", "ChatResult", "GenerateItem", "MStarAPIError", "audio_part", "image_part",
           "text_part", "user"]

# an error event inside a stream carries no status line of its own: its type says which it was
_STATUS_OF_TYPE = {"invalid_request_error": 400, "authentication_error": 401, "not_found_error": 404,
                   "rate_limit_error": 429, "server_error": 500, "service_unavailable": 503}


class MStarAPIError(Exception):
    """An error answer: ``status`` (HTTP, or implied by the error type for an error event that ended a
    stream), and the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        self.error: dict[str, Any] = error if isinstance(error, dict) else {"message": str(body)}
        self.status, self.body = status, body
        self.message: str = str(self.error.get("message", ""))
        self.type: str | None = self.error.get("type")
        self.param: str | None = self.error.get("param")
        self.code: str | None = self.error.get("code")
        super().__init__(f"{status}: {self.message}")


def raise_for_status(status: int, content: bytes) -> None:
    if status < 400:
        return
    try:
        body = json.loads(content)
    except ValueError:
        body = content.decode(errors="replace")
    raise MStarAPIError(status, body)


def raise_if_error(payload: Any) -> Any:
    """A stream's payload, or ``MStarAPIError`` when it is the error event that ended the stream."""
    if isinstance(payload, dict) and "error" in payload:
        raise MStarAPIError(_STATUS_OF_TYPE.get(str(payload["error"].get("type")), 500), payload)
    return payload


# -- chat ------------------------------------------------------------------------------------------------


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def image_part(image: bytes, mime: str = "image/png") -> dict:
    """An image input (PNG, JPEG, WebP ... bytes) as a data-URL ``image_url`` part."""
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(image).decode()}}


def audio_part(wav: bytes) -> dict:
    """A 16-bit PCM WAV file as an ``input_audio`` part."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def user(*content: str | dict) -> dict:
    """A user message: one string, or parts (strings become text parts)."""
    if len(content) == 1 and isinstance(content[0], str):
        return {"role": "user", "content": content[0]}
    return {"role": "user", "content": [text_part(c) if isinstance(c, str) else c for c in content]}


@dataclass(frozen=True)
class ChatResult:
    """One completion: its text, audio (a WAV file, when ``modalities`` asked for it), images (PNG)."""

    text: str
    finish_reason: str | None
    usage: dict[str, int]
    audio: bytes | None = None
    images: list[bytes] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape: id, type, function
    raw: dict[str, Any] = field(default_factory=dict)

    def json(self) -> Any:
        """The text parsed as JSON (an answer with ``response_format`` json_object / json_schema)."""
        return json.loads(self.text)


@dataclass(frozen=True)
class ChatDelta:
    """One streamed chunk: text, PCM16 audio bytes, images (PNG); ``usage`` on the last when asked."""

    text: str = ""
    audio: bytes = b""
    images: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # pieces: join arguments by ``index``


def chat_body(model: str, messages: list[dict], stream: bool, params: Mapping[str, Any]) -> dict:
    return {**params, "model": model, "messages": messages, "stream": stream}


def speech_body(model: str, text: str, voice: str | None, response_format: str,
                params: Mapping[str, Any]) -> dict:
    body = {**params, "model": model, "input": text, "response_format": response_format}
    if voice is not None:
        body["voice"] = voice
    return body


def _png_of(part: dict) -> bytes:
    return base64.b64decode(part["image_url"]["url"].split(",", 1)[1])


def _split_content(content: Any) -> tuple[str, list[bytes]]:
    if content is None or isinstance(content, str):
        return content or "", []
    text = "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return text, [_png_of(p) for p in content if p.get("type") == "image_url"]


def chat_result(body: dict) -> ChatResult:
    choice = body["choices"][0]
    message = choice["message"]
    text, images = _split_content(message.get("content"))
    audio = message.get("audio")
    return ChatResult(text=text, finish_reason=choice.get("finish_reason"), usage=body.get("usage") or {},
                      audio=base64.b64decode(audio["data"]) if audio else None, images=images,
                      tool_calls=message.get("tool_calls") or [], raw=body)


def chat_delta(payload: dict) -> ChatDelta:
    if not payload.get("choices"):
        return ChatDelta(usage=payload.get("usage"))
    choice = payload["choices"][0]
    delta = choice.get("delta") or {}
    text, images = _split_content(delta.get("content"))
    audio = base64.b64decode(delta["audio"]["data"]) if delta.get("audio") else b""
    return ChatDelta(text=text, audio=audio, images=images, finish_reason=choice.get("finish_reason"),
                     usage=payload.get("usage"), tool_calls=delta.get("tool_calls") or [])


# -- stream framing ----------------------------------------------------------------------------------------

DONE = object()  # the end of an SSE stream


def sse_payload(line: str) -> Any:
    """The parsed payload of one SSE line, ``None`` for a line that carries none, ``DONE`` at the end."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return DONE if data == "[DONE]" else raise_if_error(json.loads(data))


def ndjson_payload(line: str) -> Any:
    return raise_if_error(json.loads(line)) if line.strip() else None


def speech_delta(payload: dict) -> bytes | None:
    """The bytes of a ``speech.audio.delta`` event; ``None`` for ``speech.audio.done``."""
    return base64.b64decode(payload["audio"]) if payload.get("type") == "speech.audio.delta" else None


# -- images and /generate ----------------------------------------------------------------------------------


def images_of(body: dict) -> list[bytes]:
    return [base64.b64decode(d["b64_json"]) for d in body["data"]]


def form_fields(params: Mapping[str, Any]) -> dict[str, str]:
    """Multipart form values: strings as they are, anything else as JSON (the server parses it back)."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items() if v is not None}


@dataclass(frozen=True)
class GenerateItem:
    """One item a model emitted on ``/generate``: its name, where it came from, and its tensors."""

    name: str
    node: str
    walk: str
    modality: str | None
    tensors: list[Any]  # torch.Tensor


def tensor_json(value: Any) -> Any:
    """A torch tensor or numpy array as ``{dtype, shape, data}``; lists and numbers pass as JSON."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach().cpu().contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw).decode()}


def tensor_of(obj: dict) -> Any:
    import torch

    dtype = getattr(torch, obj["dtype"])
    store = torch.int16 if dtype == torch.bfloat16 else dtype
    raw = bytearray(base64.b64decode(obj["data"]))
    t = torch.frombuffer(raw, dtype=store) if raw else torch.empty(0, dtype=store)
    t = t.reshape(obj["shape"])
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def generate_body(inputs: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict:
    return {"inputs": {k: tensor_json(v) for k, v in inputs.items()}, "params": dict(params or {})}


def generate_item(payload: dict) -> GenerateItem | None:
    """An emitted item, or ``None`` for the final ``{"done": true}``."""
    if payload.get("done"):
        return None
    return GenerateItem(payload["name"], payload["node"], payload["walk"], payload.get("modality"),
                        [tensor_of(t) for t in payload["tensors"]])
