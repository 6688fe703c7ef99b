"""``MStarClient``: the HTTP API from Python, one method per route (blocking, on ``httpx.Client``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import httpx

from mstar.client import wire
from mstar.client.wire import ChatDelta, ChatResult, GenerateItem


class MStarClient:
    """A client of one mstar server. ``model`` defaults to the one the server serves (asked once).
    Every error answer raises ``MStarAPIError`` (status and OpenAI error body); so does the error
    event that ends a stream which failed after it began."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = 60.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport --------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self._http.request(method, path, **kw)
        wire.raise_for_status(r.status_code, r.content)
        return r

    def _lines(self, path: str, body: dict) -> Iterator[str]:
        with self._http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                wire.raise_for_status(r.status_code, r.read())
            yield from r.iter_lines()

    def _sse(self, path: str, body: dict) -> Iterator[Any]:
        for line in self._lines(path, body):
            payload = wire.sse_payload(line)
            if payload is wire.DONE:
                return
            if payload is not None:
                yield payload

    # -- system -----------------------------------------------------------------------------------------

    def health(self) -> dict:
        return self._request("GET", "/health").json()

    def models(self) -> list[str]:
        return [m["id"] for m in self._request("GET", "/v1/models").json()["data"]]

    def voices(self) -> list[str]:
        return self._request("GET", "/v1/audio/voices").json()["voices"]

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    def _model_of(self, params: dict[str, Any]) -> str:
        """The call's ``model`` (taken out of ``params``) or the client's."""
        return params.pop("model", None) or self.model

    # -- routes -----------------------------------------------------------------------------------------

    def chat(self, messages: list[dict], **params: Any) -> ChatResult:
        """``params``: any chat completion field (``max_tokens``, ``temperature``, ``modalities``, ...)."""
        body = wire.chat_body(self._model_of(params), messages, False, params)
        return wire.chat_result(self._request("POST", "/v1/chat/completions", json=body).json())

    def chat_stream(self, messages: list[dict], **params: Any) -> Iterator[ChatDelta]:
        body = wire.chat_body(self._model_of(params), messages, True, params)
        for payload in self._sse("/v1/chat/completions", body):
            yield wire.chat_delta(payload)

    def speech(self, input: str, *, voice: str | None = None, response_format: str = "wav",
               **params: Any) -> bytes:
        """The whole audio file (wav, pcm, flac, mp3, opus or aac)."""
        body = wire.speech_body(self._model_of(params), input, voice, response_format, params)
        return self._request("POST", "/v1/audio/speech", json=body).content

    def speech_stream(self, input: str, *, voice: str | None = None, response_format: str = "pcm",
                      **params: Any) -> Iterator[bytes]:
        """The audio as the model speaks it (SSE deltas): raw PCM16 for pcm and wav, else encoded bytes."""
        body = wire.speech_body(self._model_of(params), input, voice, response_format,
                                {**params, "stream_format": "sse"})
        for payload in self._sse("/v1/audio/speech", body):
            chunk = wire.speech_delta(payload)
            if chunk:
                yield chunk

    def images(self, prompt: str, *, n: int = 1, size: str = "256x256", **params: Any) -> list[bytes]:
        """``n`` generated images, PNG bytes each."""
        model = self._model_of(params)
        body = {**params, "model": model, "prompt": prompt, "n": n, "size": size}
        return wire.images_of(self._request("POST", "/v1/images/generations", json=body).json())

    def image_edits(self, image: bytes, prompt: str, *, n: int = 1, **params: Any) -> list[bytes]:
        """``image`` (PNG, JPEG ... bytes) edited by ``prompt``; extra fields travel as form values."""
        model = self._model_of(params)
        form = wire.form_fields({**params, "model": model, "prompt": prompt, "n": n})
        r = self._request("POST", "/v1/images/edits", data=form, files={"image": ("image", image)})
        return wire.images_of(r.json())

    def generate_stream(self, inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None,
                        ) -> Iterator[GenerateItem]:
        """The native route: tensors (torch, numpy or nested lists) by input name in, emitted items out."""
        for line in self._lines("/generate", wire.generate_body(inputs, params)):
            payload = wire.ndjson_payload(line)
            item = wire.generate_item(payload) if payload is not None else None
            if item is not None:
                yield item

    def generate(self, inputs: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> list[GenerateItem]:
        return list(self.generate_stream(inputs, params))
