"""``POST /v1/completions``: OpenAI's legacy text completions (one prompt, a list of prompts or token
ids; ``n`` choices each; ``echo``, ``logprobs``, ``stop``), as one response or as SSE chunks. Choice
``i * n + j`` is prompt ``i``'s ``j``-th; a seeded request's choice ``j`` samples with ``seed + j``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter

from mstar.model.adapter import COMPLETIONS, ApiRequest, TextDelta, TokenLogprob
from mstar.model.reads import ReadDict
from mstar.server.protocol import CompletionRequest
from mstar.server.routes.common import (
    SSE_DONE,
    ClosingStreamingResponse,
    ServingDep,
    Started,
    adapt,
    choice_body,
    ending_in_error,
    merged,
    refuse_unread,
    require,
    sent_fields,
    sse,
    start_choices,
)

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, serving: ServingDep):
    require(serving, COMPLETIONS, req.model)
    body = ReadDict(req.model_dump())
    groups = [[adapt(serving.adapter.completion_request, choice_body(body, j), prompt) for j in range(req.n)]
              for prompt in _prompts(req.prompt)]
    refuse_unread(sent_fields(req), body, serving.model_name, _ROUTE_READS)
    started = await start_choices(serving, COMPLETIONS, groups)
    call = _Call(started, [r for g in groups for r in g], serving.model_name, logprobs=req.logprobs is not None,
                 prompt_tokens=sum(g[0].prompt_tokens for g in groups))
    if not req.stream:
        return await call.collect()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ClosingStreamingResponse(ending_in_error(call.chunks(include_usage), after_error=(SSE_DONE,)),
                                    media_type="text/event-stream")


# what the route itself reads (``refuse_unread``); best_of and suffix only in their no-op values
_ROUTE_READS = frozenset({"model", "prompt", "n", "stream", "stream_options", "best_of", "suffix"})


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a body: a string, a list of strings, a list of ids, or a list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _legacy_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Log probabilities in the legacy completions shape; ``text_offset``: where each token's text
    starts in the choice's text, from ``offset``."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tokens: int = 0


@dataclass
class _Call:
    """Every choice of one completions call under way."""

    started: list[Started]
    requests: list[ApiRequest]
    model: str
    logprobs: bool
    prompt_tokens: int  # each prompt's once, however many choices it has (as OpenAI counts them)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def _usage(self, choices: list[_Choice]) -> dict[str, int]:
        done = sum(c.tokens for c in choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def _take(self, choice: _Choice, out: Any, timer: Any) -> TextDelta | None:
        if not isinstance(out, TextDelta):
            return None
        choice.tokens += out.num_tokens
        choice.logprobs.extend(out.logprobs)
        timer.token(out.num_tokens)
        return out

    async def collect(self) -> dict[str, Any]:
        choices = [_Choice() for _ in self.started]
        async for i, out in merged([s.outputs for s in self.started]):
            if (delta := self._take(choices[i], out, self.started[i].timer)) is not None:
                choices[i].text.append(delta.text)
        body = []
        for i, (c, s, r) in enumerate(zip(choices, self.started, self.requests)):
            s.timer.done()
            item: dict[str, Any] = {"index": i, "text": r.echo + "".join(c.text), "logprobs": None,
                                    "finish_reason": s.decoder.finish_reason}
            if self.logprobs:
                item["logprobs"] = _legacy_logprobs(c.logprobs, len(r.echo))
            body.append(item)
        return {**self._head(), "choices": body, "usage": self._usage(choices)}

    async def chunks(self, include_usage: bool) -> AsyncIterator[str]:
        choices = [_Choice() for _ in self.started]
        offsets = [len(r.echo) for r in self.requests]
        for i, r in enumerate(self.requests):
            if r.echo:
                yield self._chunk(i, r.echo)
        async for i, out in merged([s.outputs for s in self.started]):
            delta = self._take(choices[i], out, self.started[i].timer)
            if delta is None or not (delta.text or delta.logprobs):
                continue
            logprobs = _legacy_logprobs(list(delta.logprobs), offsets[i]) if self.logprobs else None
            offsets[i] += len(delta.text)
            yield self._chunk(i, delta.text, logprobs=logprobs)
        for i, s in enumerate(self.started):
            s.timer.done()
            yield self._chunk(i, "", s.decoder.finish_reason)
        if include_usage:
            yield sse({**self._head(), "choices": [], "usage": self._usage(choices)})
        yield SSE_DONE

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _chunk(self, index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse({**self._head(), "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                 "finish_reason": finish}]})
