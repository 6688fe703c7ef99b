"""One realtime session: a websocket's conversation (its items, kept across turns) and the response
under way.

A response is the served model's answer to the conversation so far, made through the same adapter
and runtime path as a chat completion (a speech model: ``/v1/audio/speech`` of the last user text),
and streamed as the Realtime API's events. At most one response runs at a time;
``response.cancel`` and the client leaving cancel it, which aborts its request in the runtime and
frees its KV blocks. The assistant's reply, whatever part of it was made, joins the conversation.

A model that takes audio (``ApiAdapter.accepts_audio``) also takes spoken turns: pcm16 appended to
the input audio buffer, committed by the client (``turn_detection`` null), or ``input_audio`` parts
of a user item. A turn's audio reaches the model as the chat route's ``input_audio`` parts do, so
the same audio sent as a chat completion gets the same answer. With ``turn_detection: server_vad``
(the default for a model whose graph has the VAD walk, ``ApiAdapter.detects_speech``, where the
``silero-vad`` package is installed, as in OpenAI's API) the server finds the turns itself: the
appended audio goes, a stretch of windows at a time, through the model's VAD node (a request of
its own, batched with other sessions' by the runtime), and ``vad.VadStream`` turns the
probabilities into events: speech starting marks a turn (and cancels a response under way:
barge-in), silence after it commits the turn and, with ``create_response``, answers it.

A spoken turn reaches the model as consecutive clips of ``segment_ms`` (the last one shorter), as
``input_audio`` parts, and each clip is prefilled while the user is still talking: once a clip is
complete, the adapter's ``prefill_request`` over the conversation up to that clip (the answer's
prompt: a spoken answer's has its own system prompt) computes its KV, which the prefix cache keeps
(a model whose cache reaches through audio, Qwen3-Omni's Thinker, which also keeps the states a
spoken answer's Talker reads there), so at the turn's end the response prefills only the rest. The
same clips sent as a chat completion's ``input_audio`` parts get the same prompt, so the same
greedy answer.

The session's ``temperature`` and ``max_output_tokens`` bound the whole answer, as the API's do (its
audio tokens count as output): a spoken Qwen3-Omni answer's Talker gets them too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from typing import Any

import torch
from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from mstar.model.adapter import CHAT, SPEECH, ApiRequest
from mstar.server.errors import APIError, internal_error, request_id
from mstar.server.limits import ServerLimits
from mstar.server.realtime.conversation import Item, Response
from mstar.server.realtime.events import (
    INPUT_RATE,
    EventError,
    SessionConfig,
    VadConfig,
    error_event,
    new_id,
    parse_event,
    server_event,
    update_session,
)
from mstar.server.realtime.vad import VadKind, VadStream, vad_available
from mstar.server.routes.common import adapt, start
from mstar.server.serving import Serving

__all__ = ["Item", "RealtimeSession"]

MESSAGE_TOO_BIG = 1009
MIN_TURN_SAMPLES = INPUT_RATE // 10  # a commit needs 100 ms of audio (the API's own minimum)
_RESPONSE_FIELDS = frozenset({"output_modalities", "modalities", "instructions", "max_output_tokens", "audio",
                              "voice", "conversation", "metadata", "temperature"})
_ROLES = ("user", "assistant", "system")


class RealtimeSession:
    def __init__(self, ws: WebSocket, serving: Serving, limits: ServerLimits) -> None:
        self.ws, self.serving, self.limits = ws, serving, limits
        self.adapter = serving.adapter
        self.id = new_id("sess")
        self.audio_in = self.adapter.accepts_audio
        self.audio_out = self._speaks()
        vad = VadConfig() if self._detects() else None
        self.config = SessionConfig(output_modalities=("audio",) if self.audio_out else ("text",),
                                    voice=self.adapter.default_voice, turn_detection=vad)
        self.items: list[Item] = []
        self._buffer: list[torch.Tensor] = []  # the input audio buffer: int16 at 24 kHz since the last commit / clear
        self._buffered = 0
        self._turn_start = 0  # where the buffer's turn starts (server VAD: the speech less its padding)
        self._vad: VadStream | None = None
        self._pending_item: str | None = None  # the id the buffer's turn gets (speech events name it first)
        self._speaking = False  # server VAD: a turn is under way (manual commits: whenever audio is buffered)
        self._prefilled = 0  # clips of the buffer's turn already prefilled (or being prefilled)
        self._prefills: list[asyncio.Task] = []  # under way
        self._response: Response | None = None
        self._send_lock = asyncio.Lock()
        self.closed = False

    def _detects(self) -> bool:
        """Whether server VAD can run: the model's graph has the VAD walk and silero-vad is installed."""
        return self.audio_in and self.adapter.detects_speech and vad_available()

    def _speaks(self) -> bool:
        """Whether answers can be audio (pcm16 at the API's 24 kHz): a speech model, or a chat model
        whose answers may be spoken (it has voices)."""
        a = self.adapter
        return a.sample_rate == INPUT_RATE and (SPEECH in a.routes) and (CHAT not in a.routes or bool(a.voices))

    # -- the connection --------------------------------------------------------------------------
    async def run(self) -> None:
        await self.send(server_event("session.created", session=self._describe()))
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if not await self._frame(message):
                    return
        except WebSocketDisconnect:
            return
        finally:
            self.closed = True
            await self._cancel_running()

    async def _frame(self, message: dict[str, Any]) -> bool:
        """Handle one frame; False when the session ends (an oversize frame closes it)."""
        text = message.get("text")
        if text is None:
            await self.send(error_event(EventError("binary frames are not supported: send JSON events as text",
                                                   code="invalid_event")))
            return True
        if len(text) > self.limits.max_body_bytes:
            await self.ws.close(code=MESSAGE_TOO_BIG, reason=f"event over {self.limits.max_body_bytes} bytes")
            return False
        try:
            await self._handle(parse_event(text))
        except EventError as e:
            await self.send(error_event(e))
        except APIError as e:
            await self.send(_api_error_event(e))
        except Exception as exc:  # noqa: BLE001 - a bug handling one event: logged, reported, the session goes on
            await self.send(_api_error_event(internal_error(exc)))
        return True

    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        async with self._send_lock:
            try:
                await self.ws.send_json(event)
            except (WebSocketDisconnect, RuntimeError):
                self.closed = True  # the client left; the receive loop ends the session

    async def _cancel_running(self) -> None:
        for task in (self._response.task if self._response else None, *self._prefills):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # -- events ----------------------------------------------------------------------------------
    async def _handle(self, event: dict[str, Any]) -> None:
        kind, eid = event["type"], event.get("event_id")
        try:
            if kind == "session.update":
                self._update(event.get("session"))
                await self.send(server_event("session.updated", session=self._describe()))
            elif kind == "input_audio_buffer.append":
                await self._append(event.get("audio"))
            elif kind == "input_audio_buffer.commit":
                await self._commit(None)
            elif kind == "input_audio_buffer.clear":
                self._clear()
                await self.send(server_event("input_audio_buffer.cleared"))
            elif kind == "conversation.item.create":
                await self._add_item(self._client_item(event.get("item")))
            elif kind == "response.create":
                await self._create_response(event.get("response"))
            elif kind == "response.cancel":
                await self._cancel_response(eid)
        except EventError as e:
            e.event_id = e.event_id or eid
            raise

    def _update(self, session: Any) -> None:
        config = update_session(self.config, session, self.audio_out)
        if config.turn_detection is not None and not self.audio_in:
            raise EventError(f"model {self.serving.model_name!r} takes no audio input: turn_detection must be null",
                             code="unsupported", param="session.turn_detection")
        if config.turn_detection is not None and not self._detects():
            raise EventError(f"server_vad needs the silero-vad package on the server and a VAD walk in "
                             f"{self.serving.model_name!r}'s graph; leave turn_detection null and commit each turn",
                             code="unsupported", param="session.turn_detection")
        if config.turn_detection != self.config.turn_detection:
            self._vad = None  # made with the new settings at the next append
        self.config = config

    def _describe(self) -> dict[str, Any]:
        return self.config.describe(self.serving.model_name, self.id)

    # -- the input audio buffer ------------------------------------------------------------------
    async def _append(self, audio: Any) -> None:
        if not self.audio_in:
            raise EventError(f"model {self.serving.model_name!r} takes no audio input; send text items",
                             code="unsupported", param="audio")
        pcm = self._pcm(audio, "audio")
        if self._buffered + pcm.numel() > self.limits.max_audio_samples:
            raise EventError(f"the input audio buffer holds at most {self.limits.max_audio_samples} samples "
                             f"({self.limits.max_audio_samples // INPUT_RATE} s); commit or clear it",
                             code="input_audio_buffer_full", param="audio")
        self._buffer.append(pcm)
        self._buffered += pcm.numel()
        if self.config.turn_detection is not None:
            await self._detect(pcm)
        self._maybe_prefill()

    def _pcm(self, audio: Any, param: str) -> torch.Tensor:
        if not isinstance(audio, str):
            raise EventError(f"'{param}' must be base64-encoded pcm16 (24 kHz mono, little-endian)", param=param)
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as e:
            raise EventError(f"'{param}' is not valid base64: {e}", param=param) from e
        if len(raw) % 2:
            raise EventError(f"'{param}' must hold whole pcm16 samples (an even number of bytes)", param=param)
        return torch.frombuffer(bytearray(raw), dtype=torch.int16) if raw else torch.zeros(0, dtype=torch.int16)

    async def _detect(self, pcm: torch.Tensor) -> None:
        """Feed the VAD; act on its events: a start marks the turn (and cancels a response under way),
        a stop commits the turn (and may answer it)."""
        vad = self.config.turn_detection
        if self._vad is None:
            self._vad = VadStream(vad)
            if self._buffered > pcm.numel():  # audio appended before server_vad was switched on
                pcm = torch.cat(self._buffer)
        windows = self._vad.take(pcm)
        if windows is None:
            return
        for event in await self._run_vad(windows):
            if event.kind is VadKind.STARTED:
                self._turn_start, self._prefilled, self._speaking = event.at_ms * INPUT_RATE // 1000, 0, True
                await self.send(server_event("input_audio_buffer.speech_started", audio_start_ms=event.at_ms,
                                             item_id=self._next_item_id()))
                if vad.interrupt_response and self._response is not None:  # barge-in
                    await self._cancel_response(None)
            else:
                await self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=event.at_ms,
                                             item_id=self._next_item_id()))
                await self._commit(event.at_ms * INPUT_RATE // 1000)
                if vad.create_response and self._response is None:
                    await self._create_response(None)

    async def _run_vad(self, windows: torch.Tensor) -> list:
        """The VAD walk over ``windows`` (one request, from the stream's state): its events."""
        v = self._vad
        request = self.adapter.vad_request(windows, v.state, v.context)
        out = {}
        async for item in self.serving.stream("realtime", request.inputs, request.params, trace=False):
            out[item.name] = item.value[0]
        return v.decide(out["vad_probs"], out["vad_state"], out["vad_context"])

    def _next_item_id(self) -> str:
        if self._pending_item is None:
            self._pending_item = new_id("item")
        return self._pending_item

    def _clear(self) -> None:
        self._buffer, self._buffered, self._turn_start, self._prefilled, self._speaking = [], 0, 0, 0, False
        if self._vad is not None:
            self._vad.reset()

    def _turn_clips(self, end: int | None, whole: bool) -> list[torch.Tensor]:
        """The turn's audio (from its start to ``end``) as clips of ``segment_ms``; ``whole``: with the
        last, shorter clip (merged into the one before when under 100 ms), else complete clips only."""
        audio = torch.cat(self._buffer)[self._turn_start:end] if self._buffer else torch.zeros(0, dtype=torch.int16)
        step = self.config.segment_ms * INPUT_RATE // 1000
        full = audio.numel() // step
        clips = [audio[i * step:(i + 1) * step] for i in range(full)]
        rest = audio[full * step:]
        if whole and rest.numel():
            if rest.numel() < MIN_TURN_SAMPLES and clips:
                clips[-1] = torch.cat([clips[-1], rest])
            else:
                clips.append(rest)
        return clips

    # -- prefill while the user speaks -----------------------------------------------------------
    def _maybe_prefill(self) -> None:
        """Send the turn's newly completed clips to be prefilled: one request per completed clip, each
        over the conversation up to its clip."""
        under_way = self._speaking if self.config.turn_detection is not None else self._buffered > 0
        if not under_way or CHAT not in self.adapter.routes:
            return
        clips = self._turn_clips(self._buffered, whole=False)
        if len(clips) <= self._prefilled:
            return
        self._prefilled = len(clips)
        turn = Item("pending", "user", clips=tuple(clips))
        body, audio = self._chat_body(self.config, [*self.items, turn])
        try:
            request = self.adapter.prefill_request(body, [], audio)
        except (ValueError, TypeError, KeyError):
            return  # the turn's response will say what is wrong with it
        if request is None:
            return
        self._prefills = [t for t in self._prefills if not t.done()]
        self._prefills.append(asyncio.create_task(self._prefill(request)))

    async def _prefill(self, request: ApiRequest) -> None:
        try:
            async for _ in self.serving.stream(CHAT, request.inputs, request.params, trace=False):
                pass
        except APIError:  # the server at capacity, say: the response prefills it all instead
            pass

    async def _commit(self, end: int | None) -> None:
        """The buffer's turn (from its start to ``end``, the VAD's; None: all) becomes a user item."""
        if not self.audio_in:
            raise EventError(f"model {self.serving.model_name!r} takes no audio input", code="unsupported")
        clips = self._turn_clips(end, whole=True)
        if sum(c.numel() for c in clips) < MIN_TURN_SAMPLES:
            raise EventError("the input audio buffer holds less than 100 ms of audio",
                             code="input_audio_buffer_commit_empty")
        item = Item(self._next_item_id(), "user", clips=tuple(c.clone() for c in clips))
        self._pending_item = None
        self._clear()
        previous = self.items[-1].id if self.items else None
        await self.send(server_event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous))
        await self._add_item(item)

    # -- conversation items ----------------------------------------------------------------------
    def _client_item(self, item: Any) -> Item:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise EventError("item must be a message ({'type': 'message', 'role': ..., 'content': [...]})",
                             code="unsupported", param="item")
        role = item.get("role")
        if role not in _ROLES:
            raise EventError("item.role must be user, assistant or system", param="item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise EventError("item.content must be a non-empty list of parts", param="item.content")
        text, clips = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind == "input_audio" and role == "user" and self.audio_in:
                pcm = self._pcm(part.get("audio"), "item.content.audio")
                if pcm.numel() > self.limits.max_audio_samples:
                    raise EventError(f"an audio part holds at most {self.limits.max_audio_samples} samples",
                                     param="item.content.audio")
                clips.append(pcm)
            else:
                raise EventError(f"content part {kind!r} is not supported here: send text parts "
                                 "({'type': 'input_text', 'text': ...}); input_audio in user items for models "
                                 "that take audio", code="unsupported", param="item.content")
        item_id = item.get("id")
        if item_id is not None and not isinstance(item_id, str):
            raise EventError("item.id must be a string", param="item.id")
        return Item(item_id or new_id("item"), role, "".join(text), tuple(clips))

    async def _add_item(self, item: Item) -> None:
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        await self.send(server_event("conversation.item.added", previous_item_id=previous, item=item.describe()))
        await self.send(server_event("conversation.item.done", previous_item_id=previous, item=item.describe()))

    # -- building requests -----------------------------------------------------------------------
    def _chat_body(self, config: SessionConfig, items: list[Item]) -> tuple[dict[str, Any], list[tuple[torch.Tensor, int]]]:
        """``items`` as a chat completion's body and its audio (the ``input_audio`` parts' clips)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": config.instructions}] if config.instructions else []
        audio = []
        for it in items:
            if it.clips:
                parts = [{"type": "input_audio"} for _ in it.clips] + ([{"type": "text", "text": it.text}]
                                                                       if it.text else [])
                messages.append({"role": it.role, "content": parts})
                audio += [(c, INPUT_RATE) for c in it.clips]
            else:
                messages.append({"role": it.role, "content": it.text})
        body: dict[str, Any] = {"messages": messages, "max_tokens": config.max_output_tokens,
                                "temperature": config.temperature}
        if "audio" in config.output_modalities:
            body["modalities"], body["audio"] = ["text", "audio"], {"voice": config.voice}
            # the Talker's (Qwen3-Omni's chat fields): its steps are the answer's audio tokens
            body["talker_temperature"], body["talker_max_tokens"] = config.temperature, config.max_output_tokens
        return body, audio

    def _request(self, config: SessionConfig) -> tuple[str, ApiRequest]:
        if CHAT in self.adapter.routes:
            body, audio = self._chat_body(config, self.items)
            return CHAT, adapt(self.adapter.chat_request, body, [], audio)
        text = next((it.text for it in reversed(self.items) if it.role == "user" and it.text), None)
        if text is None:
            raise EventError(f"model {self.serving.model_name!r} speaks text: add a user text item first",
                             code="unsupported")
        if config.instructions:
            raise EventError(f"model {self.serving.model_name!r} speaks the user's text: it takes no instructions",
                             code="unsupported", param="instructions")
        voices = self.adapter.voices
        if voices and config.voice not in voices:
            raise EventError(f"unknown voice {config.voice!r}; choose one of: {', '.join(voices)}", param="voice")
        body: dict[str, Any] = {"input": text, "voice": config.voice}
        if config.max_output_tokens is not None:
            body["max_tokens"] = config.max_output_tokens
        if config.temperature is not None:
            body["temperature"] = config.temperature
        return SPEECH, adapt(self.adapter.speech_request, body)

    # -- responses -------------------------------------------------------------------------------
    async def _create_response(self, overrides: Any) -> None:
        if self._response is not None:
            raise EventError("a response is already in progress; cancel it first",
                             code="conversation_already_has_active_response")
        config = self.config
        if overrides is not None:
            if not isinstance(overrides, dict) or set(overrides) - _RESPONSE_FIELDS:
                raise EventError(f"response fields must be among {sorted(_RESPONSE_FIELDS)}", code="unsupported",
                                 param="response")
            if overrides.get("conversation") not in (None, "auto"):
                raise EventError("response.conversation must be 'auto'", code="unsupported",
                                 param="response.conversation")
            config = update_session(config, {k: v for k, v in overrides.items() if k not in ("conversation", "metadata")},
                                    self.audio_out)
        response = Response(config, self.send)
        self._response = response
        response.task = asyncio.create_task(self._respond(response))

    async def _cancel_response(self, event_id: str | None) -> None:
        response = self._response
        if response is None or response.task is None:
            raise EventError("there is no response in progress", code="response_cancel_not_active", event_id=event_id)
        response.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await response.task

    async def _respond(self, r: Response) -> None:
        request_id.set(r.id)  # its runtime request's label: GET /v1/requests/{response id}/trace (this task only)
        status, error = "completed", None
        await self.send(server_event("response.created", response=r.describe("in_progress")))
        try:
            if self._prefills:  # their KV reaches the prefix cache before this prompt looks
                await asyncio.gather(*self._prefills, return_exceptions=True)
            route, request = self._request(r.config)
            started = await start(self.serving, route, request)
            r.input_tokens = request.prompt_tokens
            await r.open()
            async for out in started.outputs:
                await r.deliver(out)
            if started.decoder.finish_reason == "length":
                status = "incomplete"
        except asyncio.CancelledError:
            status = "cancelled"
        except EventError as e:
            status, error = "failed", error_event(e)
        except APIError as e:
            status, error = "failed", _api_error_event(e)
        except Exception as exc:  # noqa: BLE001 - a bug: logged with its id; this response fails, the session goes on
            status, error = "failed", _api_error_event(internal_error(exc))
        finally:
            self._response = None
        if error is not None:
            await self.send(error)
        made = await r.close(status)
        if made.text:  # the assistant's reply joins the conversation, whatever part of it was made
            self.items.append(made)


def _api_error_event(e: APIError) -> dict[str, Any]:
    kind = {429: "rate_limit_error", 503: "server_error", 500: "server_error"}.get(e.status, "invalid_request_error")
    return server_event("error", error={"type": kind, "code": e.code or str(e.status), "message": e.message,
                                        "param": e.param, "event_id": None})
