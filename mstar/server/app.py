"""The FastAPI application: OpenAI-compatible routes, native /generate, health and metrics."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mstar.model.adapter import (
    CHAT,
    GENERATE,
    IMAGE_EDITS,
    IMAGES,
    ROUTE_PATHS,
    SPEECH,
    AudioChunk,
    ImageOut,
    TextDelta,
)
from mstar.server import media
from mstar.server.errors import APIError, error_body, error_response, install_handlers
from mstar.server.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    GenerateRequest,
    ImageRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    SpeechRequest,
    Voices,
)
from mstar.server.serving import ServingEngine, Timer


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 << 20
    max_image_pixels: int = 4096 * 4096


def _form_value(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v


def create_app(engine: ServingEngine, api_key: str | None = None, limits: ServerLimits = ServerLimits()) -> FastAPI:
    app = FastAPI(title="mstar", version="0.1.0",
                  description=f"Serving {engine.model_name} with the mstar Walk Graph runtime.")
    install_handlers(app)
    adapter = engine.adapter
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path not in ("/health", "/metrics"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                      code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            return error_response(413, f"request body of {length} bytes exceeds the limit of "
                                       f"{limits.max_body_bytes} bytes")
        route = request.url.path
        response = await call_next(request)
        if route in ROUTE_PATHS.values():
            engine.metrics.requests.labels(engine.model_name, route, str(response.status_code)).inc()
        return response

    def require(route: str, model: str | None) -> None:
        if model is not None and model != engine.model_name:
            raise APIError(404, f"model {model!r} not found; this server serves {engine.model_name!r}",
                           param="model", code="model_not_found")
        if route not in adapter.routes:
            supported = ", ".join(ROUTE_PATHS[r] for r in sorted(adapter.routes))
            raise APIError(404, f"model {engine.model_name!r} does not serve {ROUTE_PATHS[route]}; "
                                f"its routes: {supported}", code="route_not_supported")

    def adapt(fn, *args):
        try:
            return fn(*args)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def first_and_rest(agen: AsyncIterator) -> tuple[Any, AsyncIterator]:
        """Start the request; admission and input errors surface here, before any byte is sent."""
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            first = None
        return first, agen

    def image_part(out: ImageOut) -> dict:
        url = "data:image/png;base64," + base64.b64encode(media.encode_png(out.pixels)).decode()
        return {"type": "image_url", "image_url": {"url": url}}

    # -- status --------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.ready:
            return error_response(503, f"not ready: {engine.runtime._lost or 'starting'}")
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        card = ModelCard(id=engine.model_name, created=created, routes=[ROUTE_PATHS[r] for r in sorted(adapter.routes)])
        return ModelList(data=[card])

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(generate_latest, engine.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # -- chat ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat(req: ChatCompletionRequest):
        require(CHAT, req.model)
        images, audio = [], []
        for m in req.messages:
            for part in m.content if isinstance(m.content, list) else []:
                if part.type == "image_url":
                    if part.image_url is None:
                        raise APIError(400, "image_url part without image_url", param="messages")
                    _, raw = adapt(media.decode_data_url, part.image_url.url, "image_url")
                    images.append(adapt(media.decode_image, raw, "image_url", limits.max_image_pixels))
                elif part.type == "input_audio":
                    if part.input_audio is None:
                        raise APIError(400, "input_audio part without input_audio", param="messages")
                    raw = adapt(media.b64decode, part.input_audio.data, "input_audio")
                    audio.append(adapt(media.decode_wav, raw, "input_audio"))
        body = req.model_dump()
        api_req = adapt(adapter.chat_request, body, images, audio)
        decoder = adapter.new_decoder(CHAT, api_req)
        timer = Timer(engine.metrics, ROUTE_PATHS[CHAT])
        first, agen = await first_and_rest(engine.stream(CHAT, api_req.inputs, api_req.params))
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        want_audio = bool(req.modalities and "audio" in req.modalities)

        async def outputs():
            if first is not None:
                for out in decoder.feed(first.name, first.value):
                    yield out
            async for item in agen:
                for out in decoder.feed(item.name, item.value):
                    yield out
            for out in decoder.finish():
                yield out

        if not req.stream:
            text, pcm, images, n_tokens = [], [], [], 0
            async for out in outputs():
                if isinstance(out, TextDelta):
                    text.append(out.text)
                    n_tokens += out.num_tokens
                    timer.token(out.num_tokens)
                elif isinstance(out, AudioChunk):
                    timer.audio()
                    pcm.append(out.pcm)
                elif isinstance(out, ImageOut):
                    images.append(image_part(out))
            content = "".join(text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if images:  # images out: content becomes a list of parts, text first
                message["content"] = ([{"type": "text", "text": content}] if content else []) + images
            audio_s = 0.0
            if want_audio and pcm:
                wav, _ = media.encode_audio(torch.cat(pcm), adapter.sample_rate, "wav")
                audio_s = sum(p.numel() for p in pcm) / adapter.sample_rate
                message["audio"] = {"id": f"audio_{uuid.uuid4().hex[:16]}", "data": base64.b64encode(wav).decode(),
                                    "expires_at": now + 3600, "transcript": content}
            timer.done(audio_s)
            return {"id": rid, "object": "chat.completion", "created": now, "model": engine.model_name,
                    "choices": [{"index": 0, "message": message, "finish_reason": decoder.finish_reason}],
                    "usage": {"prompt_tokens": api_req.prompt_tokens, "completion_tokens": n_tokens,
                              "total_tokens": api_req.prompt_tokens + n_tokens}}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, finish: str | None = None) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": engine.model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(body)}\n\n"

        async def sse():
            n_tokens = 0
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for out in outputs():
                    if isinstance(out, TextDelta):
                        n_tokens += out.num_tokens
                        timer.token(out.num_tokens)
                        if out.text:
                            yield chunk({"content": out.text})
                    elif isinstance(out, AudioChunk) and want_audio:
                        timer.audio()
                        yield chunk({"audio": {"data": base64.b64encode(media.pcm_bytes(out.pcm)).decode()}})
                    elif isinstance(out, ImageOut):
                        yield chunk({"content": [image_part(out)]})
            except APIError as e:
                yield f"data: {json.dumps(error_body(e.status, e.message))}\n\n"
                yield "data: [DONE]\n\n"
                return
            yield chunk({}, decoder.finish_reason)
            if include_usage:
                usage = {"prompt_tokens": api_req.prompt_tokens, "completion_tokens": n_tokens,
                         "total_tokens": api_req.prompt_tokens + n_tokens}
                yield f"data: {json.dumps({'id': rid, 'object': 'chat.completion.chunk', 'created': now, 'model': engine.model_name, 'choices': [], 'usage': usage})}\n\n"  # noqa: E501
            timer.done()
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    # -- speech --------------------------------------------------------------------------------
    @app.get("/v1/audio/voices", response_model=Voices)
    async def voices():
        require(SPEECH, None)
        return Voices(voices=list(adapter.voices))

    @app.post("/v1/audio/speech")
    async def speech(req: SpeechRequest):
        require(SPEECH, req.model)
        if req.voice is not None and adapter.voices and req.voice not in adapter.voices:
            raise APIError(400, f"unknown voice {req.voice!r}; voices: {', '.join(adapter.voices)}", param="voice")
        if req.response_format not in ("wav", "pcm", "flac"):
            raise APIError(400, f"response_format {req.response_format!r} is not supported; use wav, pcm or flac",
                           param="response_format")
        if req.stream_format is not None and req.response_format not in ("wav", "pcm"):
            raise APIError(400, "streaming supports response_format wav or pcm", param="response_format")
        api_req = adapt(adapter.speech_request, req.model_dump())
        decoder = adapter.new_decoder(SPEECH, api_req)
        timer = Timer(engine.metrics, ROUTE_PATHS[SPEECH])
        rate = adapter.sample_rate
        first, agen = await first_and_rest(engine.stream(SPEECH, api_req.inputs, api_req.params))

        async def chunks():
            items = ([first] if first is not None else [])
            for it in items:
                for out in decoder.feed(it.name, it.value):
                    if isinstance(out, AudioChunk):
                        yield out.pcm
            async for it in agen:
                for out in decoder.feed(it.name, it.value):
                    if isinstance(out, AudioChunk):
                        yield out.pcm
            for out in decoder.finish():
                if isinstance(out, AudioChunk):
                    yield out.pcm

        if req.stream_format is None:
            pcm = [p async for p in chunks()]
            audio = torch.cat(pcm) if pcm else torch.zeros(0, dtype=torch.int16)
            timer.done(audio.numel() / rate)
            data, mime = adapt(media.encode_audio, audio, rate, req.response_format)
            return Response(data, media_type=mime)

        if req.stream_format == "audio":
            async def audio_stream():
                n = 0
                if req.response_format == "wav":
                    yield media.wav_header(rate)
                async for p in chunks():
                    timer.audio()
                    n += p.numel()
                    yield media.pcm_bytes(p)
                timer.done(n / rate)

            return StreamingResponse(audio_stream(), media_type="audio/wav" if req.response_format == "wav"
                                     else "audio/pcm")

        async def sse():
            n = 0
            try:
                async for p in chunks():
                    timer.audio()
                    n += p.numel()
                    ev = {"type": "speech.audio.delta", "audio": base64.b64encode(media.pcm_bytes(p)).decode()}
                    yield f"data: {json.dumps(ev)}\n\n"
            except APIError as e:
                yield f"data: {json.dumps(error_body(e.status, e.message))}\n\n"
                return
            timer.done(n / rate)
            yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    # -- images --------------------------------------------------------------------------------
    async def run_images(route: str, body: dict, image: torch.Tensor | None, n: int) -> ImagesResponse:
        # the n images run as n concurrent requests (the runtime batches them); all inputs are
        # validated before any starts, so a bad request starts nothing
        reqs = [adapt(adapter.image_request, {**body, "index": i}, image) for i in range(n)]

        async def one(api_req) -> list[dict]:
            decoder = adapter.new_decoder(route, api_req)
            timer = Timer(engine.metrics, ROUTE_PATHS[route])
            first, agen = await first_and_rest(engine.stream(route, api_req.inputs, api_req.params))
            outs = []
            if first is not None:
                outs += decoder.feed(first.name, first.value)
            async for it in agen:
                outs += decoder.feed(it.name, it.value)
            outs += decoder.finish()
            timer.done()
            return [{"b64_json": base64.b64encode(media.encode_png(o.pixels)).decode()}
                    for o in outs if isinstance(o, ImageOut)]

        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # one failed (or the client left): stop the others, which aborts them
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return ImagesResponse(created=int(time.time()), data=[d for r in results for d in r])

    def parse_size(size: str) -> tuple[int, int]:
        try:
            w, h = (int(x) for x in size.lower().split("x"))
        except ValueError as e:
            raise APIError(400, f"size must look like 256x256, got {size!r}", param="size") from e
        if w <= 0 or h <= 0:
            raise APIError(400, f"size must be positive, got {size!r}", param="size")
        return w, h

    @app.post("/v1/images/generations", response_model=ImagesResponse)
    async def images(req: ImageRequest):
        require(IMAGES, req.model)
        body = req.model_dump()
        body["width"], body["height"] = parse_size(req.size)
        return await run_images(IMAGES, body, None, req.n)

    @app.post("/v1/images/edits", response_model=ImagesResponse)
    async def image_edits(request: Request, image: Annotated[UploadFile, File()], prompt: Annotated[str, Form()],
                          model: Annotated[str, Form()], n: Annotated[int, Form()] = 1,
                          size: Annotated[str, Form()] = "256x256"):
        require(IMAGE_EDITS, model)
        if not 1 <= n <= 4:
            raise APIError(400, "n must be between 1 and 4", param="n")
        raw = await image.read()
        pixels = adapt(media.decode_image, raw, "image", limits.max_image_pixels)
        # other form fields (the SDK's extra_body: seed, steps, guidance...) as JSON values where they parse
        extra = {k: _form_value(v) for k, v in (await request.form()).items()
                 if k not in ("image", "prompt", "model", "n", "size") and isinstance(v, str)}
        body = {**extra, "model": model, "prompt": prompt, "n": n, "size": size}
        body["width"], body["height"] = parse_size(size)
        return await run_images(IMAGE_EDITS, body, pixels, n)

    # -- native --------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(req: GenerateRequest):
        require(GENERATE, None)
        inputs = {k: adapt(media.tensor_from_json, v, f"inputs.{k}") for k, v in req.inputs.items()}
        first, agen = await first_and_rest(engine.stream(GENERATE, inputs, dict(req.params)))

        def line(item) -> str:
            return json.dumps({"name": item.name, "modality": item.modality, "node": item.node, "walk": item.walk,
                               "tensors": [media.tensor_to_json(t) for t in item.value]}) + "\n"

        async def ndjson():
            if first is not None:
                yield line(first)
            try:
                async for item in agen:
                    yield line(item)
            except APIError as e:
                yield json.dumps(error_body(e.status, e.message)) + "\n"
                return
            yield json.dumps({"done": True}) + "\n"

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    app.state.engine = engine
    return app
