"""``AsyncMStarClient``: ``MStarClient``'s methods as coroutines and async iterators (``httpx.AsyncClient``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from mstar.client import wire
from mstar.client.wire import ChatDelta, ChatResult, GenerateItem


class AsyncMStarClient:
    """The async twin of ``MStarClient``: same methods, same errors (``MStarAPIError``)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = 60.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMStarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- transport --------------------------------------------------------------------------------------

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = await self._http.request(method, path, **kw)
        wire.raise_for_status(r.status_code, r.content)
        return r

    async def _lines(self, path: str, body: dict) -> AsyncIterator[str]:
        async with self._http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                wire.raise_for_status(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                yield line

    async def _sse(self, path: str, body: dict) -> AsyncIterator[Any]:
        async for line in self._lines(path, body):
            payload = wire.sse_payload(line)
            if payload is wire.DONE:
                return
            if payload is not None:
                yield payload

    # -- system -----------------------------------------------------------------------------------------

    async def health(self) -> dict:
        return (await self._request("GET", "/health")).json()

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._request("GET", "/v1/models")).json()["data"]]

    async def voices(self) -> list[str]:
        return (await self._request("GET", "/v1/audio/voices")).json()["voices"]

    async def model(self) -> str:
        if self._model is None:
            self._model = (await self.models())[0]
        return self._model

    async def _model_of(self, params: dict[str, Any]) -> str:
        return params.pop("model", None) or await self.model()

    # -- routes -----------------------------------------------------------------------------------------

    async def chat(self, messages: list[dict], **params: Any) -> ChatResult:
        body = wire.chat_body(await self._model_of(params), messages, False, params)
        return wire.chat_result((await self._request("POST", "/v1/chat/completions", json=body)).json())

    async def chat_stream(self, messages: list[dict], **params: Any) -> AsyncIterator[ChatDelta]:
        body = wire.chat_body(await self._model_of(params), messages, True, params)
        async for payload in self._sse("/v1/chat/completions", body):
            yield wire.chat_delta(payload)

    async def speech(self, input: str, *, voice: str | None = None, response_format: str = "wav",
                     **params: Any) -> bytes:
        body = wire.speech_body(await self._model_of(params), input, voice, response_format, params)
        return (await self._request("POST", "/v1/audio/speech", json=body)).content

    async def speech_stream(self, input: str, *, voice: str | None = None, response_format: str = "pcm",
                            **params: Any) -> AsyncIterator[bytes]:
        body = wire.speech_body(await self._model_of(params), input, voice, response_format,
                                {**params, "stream_format": "sse"})
        async for payload in self._sse("/v1/audio/speech", body):
            chunk = wire.speech_delta(payload)
            if chunk:
                yield chunk

    async def images(self, prompt: str, *, n: int = 1, size: str = "256x256", **params: Any) -> list[bytes]:
        model = await self._model_of(params)
        body = {**params, "model": model, "prompt": prompt, "n": n, "size": size}
        return wire.images_of((await self._request("POST", "/v1/images/generations", json=body)).json())

    async def image_edits(self, image: bytes, prompt: str, *, n: int = 1, **params: Any) -> list[bytes]:
        model = await self._model_of(params)
        form = wire.form_fields({**params, "model": model, "prompt": prompt, "n": n})
        r = await self._request("POST", "/v1/images/edits", data=form, files={"image": ("image", image)})
        return wire.images_of(r.json())

    async def generate_stream(self, inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None,
                              ) -> AsyncIterator[GenerateItem]:
        async for line in self._lines("/generate", wire.generate_body(inputs, params)):
            payload = wire.ndjson_payload(line)
            item = wire.generate_item(payload) if payload is not None else None
            if item is not None:
                yield item

    async def generate(self, inputs: Mapping[str, Any],
                       params: Mapping[str, Any] | None = None) -> list[GenerateItem]:
        return [item async for item in self.generate_stream(inputs, params)]
