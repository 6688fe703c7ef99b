"""What a realtime session's events describe: ``Item`` (a conversation item) and ``Response`` (one
response: its settings, what it has made so far, and the events of its output, sent through the
session's ``send``)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.model.adapter import AudioChunk, TextDelta
from mstar.server import media
from mstar.server.realtime.events import SessionConfig, new_id, server_event

__all__ = ["Item", "Response"]


@dataclass(frozen=True)
class Item:
    """A conversation item: a message's role, its text and (a user's spoken turn) its audio clips."""

    id: str
    role: str
    text: str = ""
    clips: tuple[torch.Tensor, ...] = ()  # int16 at 24 kHz
    spoken: bool = False  # an assistant's answer given as audio (``text`` is its transcript)

    def describe(self, status: str = "completed") -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "input_audio", "transcript": None} for _ in self.clips]
        if self.spoken:
            content.append({"type": "output_audio", "transcript": self.text})
        elif self.text or not self.clips:
            content.append({"type": "output_text" if self.role == "assistant" else "input_text", "text": self.text})
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role, "status": status,
                "content": content}


@dataclass
class Response:
    """One response: its output is one assistant item (text, or audio with its transcript)."""

    config: SessionConfig
    send: Callable[[dict[str, Any]], Awaitable[None]]
    id: str = field(default_factory=lambda: new_id("resp"))
    item: Item = None  # type: ignore[assignment]  # set in __post_init__
    task: asyncio.Task | None = None
    text: list[str] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.item is None:
            self.item = Item(new_id("item"), "assistant", spoken=self.spoken)

    @property
    def spoken(self) -> bool:
        return "audio" in self.config.output_modalities

    def describe(self, status: str) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "realtime.response", "status": status,
                               "output_modalities": list(self.config.output_modalities),
                               "output": [self.item.describe(status)] if status != "in_progress" else []}
        if status != "in_progress":
            out["usage"] = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                            "total_tokens": self.input_tokens + self.output_tokens}
        return out

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def _part(self) -> dict[str, Any]:
        text = "".join(self.text)
        return {"type": "audio", "transcript": text} if self.spoken else {"type": "text", "text": text}

    async def open(self) -> None:
        await self.send(server_event("response.output_item.added", response_id=self.id, output_index=0,
                                     item=self.item.describe("in_progress")))
        await self.send(server_event("response.content_part.added", **self._where(), part=self._part()))

    async def deliver(self, out: Any) -> None:
        """One of the decoder's outputs as its delta event."""
        if isinstance(out, TextDelta):
            self.output_tokens += out.num_tokens
            if out.text:
                self.text.append(out.text)
                kind = "response.output_audio_transcript.delta" if self.spoken else "response.output_text.delta"
                await self.send(server_event(kind, **self._where(), delta=out.text))
        elif isinstance(out, AudioChunk) and self.spoken and out.pcm.numel():
            await self.send(server_event("response.output_audio.delta", **self._where(),
                                         delta=base64.b64encode(media.pcm_bytes(out.pcm)).decode()))

    async def close(self, status: str) -> Item:
        """The done events of the output, then ``response.done``; returns the assistant's item as made
        (whatever part of it was)."""
        self.item = dataclasses.replace(self.item, text="".join(self.text))
        if status != "failed":
            where = self._where()
            if self.spoken:
                await self.send(server_event("response.output_audio.done", **where))
                await self.send(server_event("response.output_audio_transcript.done", **where,
                                             transcript=self.item.text))
            else:
                await self.send(server_event("response.output_text.done", **where, text=self.item.text))
            await self.send(server_event("response.content_part.done", **where, part=self._part()))
            await self.send(server_event("response.output_item.done", response_id=self.id, output_index=0,
                                         item=self.item.describe(status)))
        await self.send(server_event("response.done", response=self.describe(status)))
        return self.item
