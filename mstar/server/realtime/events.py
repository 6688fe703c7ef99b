"""The Realtime API's event vocabulary: client events parsed and checked, the session's settings, and
server events built with the field names of the OpenAI SDK's ``openai.types.realtime`` models.

Only what this server does is accepted: a field it would ignore silently (tools, transcription,
noise reduction, other audio formats) is an ``error`` event naming it, so a client never believes
a setting took effect when it did not.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLIENT_EVENTS",
    "INPUT_RATE",
    "EventError",
    "SessionConfig",
    "VadConfig",
    "error_event",
    "new_id",
    "parse_event",
    "server_event",
    "update_session",
]

INPUT_RATE = 24_000  # pcm16 mono little-endian, the only input format (the API's "audio/pcm" at 24 kHz)

CLIENT_EVENTS = frozenset({
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "response.create",
    "response.cancel",
})


class EventError(Exception):
    """A client event this server cannot act on: answered with an ``error`` event, the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.event_id = message, code, param, event_id


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: EventError) -> dict[str, Any]:
    return server_event("error", error={"type": "invalid_request_error", "code": err.code, "message": err.message,
                                        "param": err.param, "event_id": err.event_id})


def parse_event(text: str) -> dict[str, Any]:
    """One client frame -> its event (a JSON object with a known ``type``)."""
    try:
        event = json.loads(text)
    except ValueError as e:
        raise EventError(f"the frame is not JSON: {e}", code="invalid_json") from e
    if not isinstance(event, dict):
        raise EventError("an event must be a JSON object", code="invalid_event")
    kind, event_id = event.get("type"), event.get("event_id")
    event_id = event_id if isinstance(event_id, str) else None
    if not isinstance(kind, str):
        raise EventError("the event has no 'type'", code="invalid_event", param="type", event_id=event_id)
    if kind not in CLIENT_EVENTS:
        raise EventError(f"unknown event type {kind!r}; this server handles: {', '.join(sorted(CLIENT_EVENTS))}",
                         code="unknown_event_type", param="type", event_id=event_id)
    return event


@dataclass(frozen=True)
class VadConfig:
    """``turn_detection: {"type": "server_vad", ...}`` with the API's defaults."""

    threshold: float = 0.5  # speech probability from which a window counts as speech
    prefix_padding_ms: int = 300  # audio kept before the detected start
    silence_duration_ms: int = 500  # silence that ends a turn
    create_response: bool = True  # answer each turn when it ends
    interrupt_response: bool = True  # speech starting during a response cancels it


@dataclass(frozen=True)
class SessionConfig:
    instructions: str | None = None
    output_modalities: tuple[str, ...] = ("text",)
    voice: str | None = None
    turn_detection: VadConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    segment_ms: int = 2000  # a spoken turn reaches the model as clips of this length (each prefilled as it ends)

    def describe(self, model: str, session_id: str) -> dict[str, Any]:
        """The ``session`` object of ``session.created`` / ``session.updated`` (GA shape)."""
        vad = None if self.turn_detection is None else {"type": "server_vad",
                                                         **dataclasses.asdict(self.turn_detection)}
        return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
                "instructions": self.instructions or "", "output_modalities": list(self.output_modalities),
                "max_output_tokens": self.max_output_tokens or "inf", "input_audio_segment_ms": self.segment_ms,
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}, "turn_detection": vad},
                          "output": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}, "voice": self.voice}}}


_SESSION_FIELDS = frozenset({"type", "model", "instructions", "output_modalities", "modalities", "audio", "voice",
                             "input_audio_format", "output_audio_format", "turn_detection", "max_output_tokens",
                             "max_response_output_tokens", "temperature", "input_audio_segment_ms", "tool_choice", "tools", "tracing", "include", "input_audio_transcription"})
_ACCEPTED_EMPTY = ("tool_choice", "tools", "tracing", "include", "input_audio_transcription")


def update_session(config: SessionConfig, session: Any, audio_out: bool) -> SessionConfig:
    """``config`` with a ``session.update``'s ``session`` applied (GA names, and the beta names
    ``modalities`` / ``voice`` / ``input_audio_format`` / ``turn_detection`` that clients still send)."""
    if not isinstance(session, Mapping):
        raise EventError("'session' must be an object", param="session")
    unknown = sorted(set(session) - _SESSION_FIELDS)
    if unknown:
        raise EventError(f"session fields {unknown} are not supported", code="unsupported", param="session")
    for name in _ACCEPTED_EMPTY:  # a client library may send these empty: fine; set, they would be ignored
        if session.get(name) not in (None, [], {}, "auto", "none"):
            raise EventError(f"session.{name} is not supported by this server", code="unsupported",
                             param=f"session.{name}")
    out = config
    if "instructions" in session:
        out = dataclasses.replace(out, instructions=_str_or_none(session["instructions"], "session.instructions"))
    modalities = session.get("output_modalities", session.get("modalities"))
    if modalities is not None:
        out = dataclasses.replace(out, output_modalities=_modalities(modalities, audio_out))
    audio = session.get("audio")
    if audio is not None:
        out = _audio_config(out, audio)
    if "voice" in session:
        out = dataclasses.replace(out, voice=_str_or_none(session["voice"], "session.voice"))
    for name in ("input_audio_format", "output_audio_format"):
        if session.get(name) not in (None, "pcm16"):
            raise EventError(f"session.{name} must be 'pcm16' (24 kHz mono)", param=f"session.{name}")
    if "turn_detection" in session:
        out = dataclasses.replace(out, turn_detection=_turn_detection(session["turn_detection"], "session.turn_detection"))
    for name in ("max_output_tokens", "max_response_output_tokens"):
        if name in session:
            out = dataclasses.replace(out, max_output_tokens=_max_tokens(session[name], f"session.{name}"))
    if "temperature" in session:
        out = dataclasses.replace(out, temperature=_number(session["temperature"], "session.temperature", 0.0, 2.0))
    if "input_audio_segment_ms" in session:  # this server's own field: the clips a spoken turn is sent as
        out = dataclasses.replace(out, segment_ms=int(_number(session["input_audio_segment_ms"],
                                                              "session.input_audio_segment_ms", 200, 30_000)))
    return out


def _audio_config(config: SessionConfig, audio: Any) -> SessionConfig:
    if not isinstance(audio, Mapping) or set(audio) - {"input", "output"}:
        raise EventError("session.audio must be an object with 'input' and/or 'output'", param="session.audio")
    inp, outp = audio.get("input") or {}, audio.get("output") or {}
    if not isinstance(inp, Mapping) or not isinstance(outp, Mapping):
        raise EventError("session.audio.input and .output must be objects", param="session.audio")
    bad = sorted((set(inp) - {"format", "turn_detection", "transcription", "noise_reduction"})
                 | {f"output.{k}" for k in set(outp) - {"format", "voice", "speed"}})
    if bad:
        raise EventError(f"session.audio fields {bad} are not supported", code="unsupported", param="session.audio")
    for where, fmt in (("input", inp.get("format")), ("output", outp.get("format"))):
        _check_format(fmt, f"session.audio.{where}.format")
    for name in ("transcription", "noise_reduction"):
        if inp.get(name) is not None:
            raise EventError(f"session.audio.input.{name} is not supported", code="unsupported",
                             param=f"session.audio.input.{name}")
    if outp.get("speed") not in (None, 1, 1.0):
        raise EventError("session.audio.output.speed other than 1.0 is not supported", code="unsupported",
                         param="session.audio.output.speed")
    out = config
    if "turn_detection" in inp:
        out = dataclasses.replace(out, turn_detection=_turn_detection(inp["turn_detection"],
                                                                      "session.audio.input.turn_detection"))
    if "voice" in outp:
        out = dataclasses.replace(out, voice=_str_or_none(outp["voice"], "session.audio.output.voice"))
    return out


def _check_format(fmt: Any, param: str) -> None:
    if fmt is None:
        return
    if not isinstance(fmt, Mapping) or fmt.get("type", "audio/pcm") != "audio/pcm" \
            or fmt.get("rate", INPUT_RATE) != INPUT_RATE:
        raise EventError(f"{param} must be {{'type': 'audio/pcm', 'rate': {INPUT_RATE}}}", param=param)


def _turn_detection(value: Any, param: str) -> VadConfig | None:
    if value is None or value == {"type": "none"}:
        return None
    if not isinstance(value, Mapping) or value.get("type") != "server_vad":
        raise EventError(f"{param} must be null or {{'type': 'server_vad', ...}} (semantic_vad is not supported)",
                         code="unsupported", param=param)
    extra = sorted(set(value) - {"type", *(f.name for f in dataclasses.fields(VadConfig)), "idle_timeout_ms"})
    if extra:
        raise EventError(f"{param} fields {extra} are not supported", code="unsupported", param=param)
    if value.get("idle_timeout_ms") is not None:
        raise EventError(f"{param}.idle_timeout_ms is not supported", code="unsupported", param=param)
    d = VadConfig()
    return VadConfig(
        threshold=_number(value.get("threshold", d.threshold), f"{param}.threshold", 0.0, 1.0),
        prefix_padding_ms=int(_number(value.get("prefix_padding_ms", d.prefix_padding_ms), f"{param}.prefix_padding_ms",
                                      0, 10_000)),
        silence_duration_ms=int(_number(value.get("silence_duration_ms", d.silence_duration_ms),
                                        f"{param}.silence_duration_ms", 0, 10_000)),
        create_response=_bool(value.get("create_response", d.create_response), f"{param}.create_response"),
        interrupt_response=_bool(value.get("interrupt_response", d.interrupt_response), f"{param}.interrupt_response"))


def _modalities(value: Any, audio_out: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not set(value) <= {"text", "audio"}:
        raise EventError("output_modalities must be ['text'] or ['audio'] (or both)", param="session.output_modalities")
    if "audio" in value and not audio_out:
        raise EventError("this model does not produce audio; use output_modalities ['text']",
                         code="unsupported", param="session.output_modalities")
    return ("audio",) if "audio" in value else ("text",)


def _max_tokens(value: Any, param: str) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 32768:
        raise EventError(f"{param} must be an integer in [1, 32768] or 'inf'", param=param)
    return value


def _number(value: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise EventError(f"{param} must be a number in [{lo:g}, {hi:g}], got {value!r}", param=param)
    return float(value)


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise EventError(f"{param} must be true or false", param=param)
    return value


def _str_or_none(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventError(f"{param} must be a string", param=param)
    return value
