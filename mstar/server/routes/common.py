"""What every route shares: the app's serving bridge and limits, the model and route checks, starting a
request and decoding its items, and the event that ends a stream which failed after it began."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mstar.model.adapter import ROUTE_PATHS, ApiRequest, AudioChunk, ImageOut, ItemDecoder, TextDelta
from mstar.model.reads import ReadDict
from mstar.runtime.handles import StreamItem
from mstar.server import media
from mstar.server.errors import SHAPE_ERRORS, APIError, api_error, error_body, internal_error
from mstar.server.limits import ServerLimits
from mstar.server.protocol import CHAT_OPTIONS
from mstar.server.serving import Serving, Timer

Output = TextDelta | AudioChunk | ImageOut


# -- what create_app put on app.state ----------------------------------------------------------------
# async, so FastAPI calls them on the event loop rather than in its thread pool


async def _serving(request: Request) -> Serving:
    return request.app.state.serving


async def _limits(request: Request) -> ServerLimits:
    return request.app.state.limits


ServingDep = Annotated[Serving, Depends(_serving)]
Limits = Annotated[ServerLimits, Depends(_limits)]


# -- checks ----------------------------------------------------------------------------------------


def require(serving: Serving, route: str, model: str | None) -> None:
    """404 unless this server serves ``model`` (when the body names one) and its model serves ``route``."""
    if model is not None and model != serving.model_name:
        raise APIError(404, f"model {model!r} not found; this server serves {serving.model_name!r}",
                       param="model", code="model_not_found")
    routes = serving.adapter.routes
    if route not in routes:
        supported = ", ".join(ROUTE_PATHS[r] for r in sorted(routes))
        raise APIError(404, f"model {serving.model_name!r} does not serve {ROUTE_PATHS[route]}; "
                            f"its routes: {supported}", code="route_not_supported")


# -- the rule: every field a client sets has an effect or is refused -----------------------------------


def sent_fields(req: BaseModel) -> list[str]:
    """The fields a client set to something other than their no-op value: a declared field set to a
    value other than its default (and, for the optional chat fields, other than their no-op value,
    ``CHAT_OPTIONS``), and every extra field not null."""
    out = []
    for name in req.model_fields_set:
        info = type(req).model_fields.get(name)
        value = getattr(req, name, None)
        if info is None or value is None or value == info.default:
            continue
        if name in CHAT_OPTIONS and not CHAT_OPTIONS[name](value):
            continue
        out.append(name)
    out.extend(k for k, v in (req.model_extra or {}).items() if v is not None)
    return sorted(out)


def refuse_unread(sent: list[str], body: ReadDict, model: str, route_reads: frozenset[str] = frozenset()) -> None:
    """400 naming the first field the client set (``sent``, e.g. ``sent_fields``) that neither the
    route (``route_reads``) nor the model's adapter read: a field this model does not implement."""
    for name in sent:
        if name not in body.read and name not in route_reads:
            raise APIError(400, f"{name} is not supported by {model} (remove it, or send its no-op value)",
                           param=name)




def adapt(fn: Callable[..., Any], *args: Any) -> Any:
    """Call an adapter or media function; the ``ValueError`` it raises for bad input becomes a 400.
    So does a ``TypeError`` (and kin) from a body of the wrong shape, logged in case it is a bug."""
    try:
        return fn(*args)
    except (ValueError, *SHAPE_ERRORS) as e:
        raise api_error(e, getattr(fn, "__qualname__", str(fn))) from e


def png_base64(pixels: Any) -> str:
    return base64.b64encode(media.encode_png(pixels)).decode()


# -- starting a request and decoding its items -------------------------------------------------------


async def started(serving: Serving, route: str, inputs: dict[str, Any],
                  params: dict[str, Any], decoder: ItemDecoder | None = None) -> AsyncIterator[StreamItem]:
    """Submit and wait for the first item, so that admission and input errors surface as a plain HTTP
    error before any byte of the response is sent; the iterator returned yields every item.

    A client that leaves cancels (or drops) the chain of generators over the serving's stream, whose
    ``finally`` then aborts the request."""
    items = serving.stream(route, inputs, params, decoder)
    try:
        head: tuple[StreamItem, ...] = (await anext(items),)
    except StopAsyncIteration:
        head = ()
    return _replay(head, items)


async def _replay(head: tuple[StreamItem, ...], rest: AsyncIterator[StreamItem]) -> AsyncIterator[StreamItem]:
    for item in head:
        yield item
    async for item in rest:
        yield item


@dataclass(frozen=True)
class Started:
    """A started request of an OpenAI route: its decoder, its latency timer and its decoded outputs."""

    decoder: ItemDecoder
    timer: Timer
    outputs: AsyncIterator[Output]


async def start(serving: Serving, route: str, api_req: ApiRequest) -> Started:
    decoder = serving.adapter.new_decoder(route, api_req)
    timer = Timer(serving.metrics, ROUTE_PATHS[route])  # before the submit: latency includes admission
    items = await started(serving, route, api_req.inputs, api_req.params, decoder)
    return Started(decoder, timer, _decoded(items, decoder))


def choice_body(body: ReadDict, j: int) -> ReadDict:
    """Choice ``j``'s body (of ``n``): a seed moves on by ``j``, so that seeded choices differ and reproduce."""
    seed = dict.get(body, "seed")  # the route's own look, not the adapter's read
    if j == 0 or seed is None:
        return body
    return body.with_changes(seed=seed + j)


async def start_choices(serving: Serving, route: str, groups: list[list[ApiRequest]]) -> list[Started]:
    """Start every choice of a call, in order (``groups``: per prompt, its ``n`` requests). The first
    choice of each prompt starts first; once its first item came, its prompt's full KV blocks are in
    the prefix cache, and the prompt's other choices start and reuse them (the shared prompt is
    prefilled once, less its last partial block). A choice that cannot start (a 429) closes the
    others and raises."""
    firsts = await _start_all(serving, route, [g[0] for g in groups])
    try:
        rests = await _start_all(serving, route, [r for g in groups for r in g[1:]])
    except BaseException:
        await _close(firsts)
        raise
    out, it = [], iter(rests)
    for first, group in zip(firsts, groups):
        out.append(first)
        out.extend(next(it) for _ in group[1:])
    return out


async def _start_all(serving: Serving, route: str, requests: list[ApiRequest]) -> list[Started]:
    results = await asyncio.gather(*(start(serving, route, r) for r in requests), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await _close([r for r in results if isinstance(r, Started)])
        raise failed[0]
    return list(results)


async def _close(started: list[Started]) -> None:
    for s in started:
        await s.outputs.aclose()  # aborts its runtime request


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, item)`` of several async iterators as their items come; closing it (or an error in
    one) stops them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, end))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each stream's own ``finally`` has run
        for s in streams:
            close = getattr(s, "aclose", None)
            if close is not None:
                await close()


async def _decoded(items: AsyncIterator[StreamItem], decoder: ItemDecoder) -> AsyncIterator[Output]:
    """The decoder's outputs of every item; once the decoder is ``done`` (a stop string), no more items
    are read: closing the stream cancels the runtime request, as a finished one (not counted aborted)."""
    async for item in items:
        for out in decoder.feed(item.name, item.value):
            yield out
        if decoder.done:
            await items.aclose()
            break
    for out in decoder.finish():
        yield out


# -- stream framing ----------------------------------------------------------------------------------


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body however the response ends. A client that leaves
    while a chunk is being sent cancels that send, not the body generator, which stays suspended at
    its yield: left to the garbage collector, its request would go on running (and count against
    ``--max-queue``) until a collection finds it; closed here, ``Serving.stream`` aborts it now."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def ndjson(payload: Any) -> str:
    return json.dumps(payload) + "\n"


async def ending_in_error(events: AsyncIterator[str], frame: Callable[[Any], str] = sse,
                          after_error: tuple[str, ...] = ()) -> AsyncIterator[str]:
    """Pass ``events`` through. The status line went out with the first byte, so a request that fails
    later ends its stream with one event holding an OpenAI error body (then ``after_error``)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - an internal error is logged; the client gets its id
        e = exc if isinstance(exc, APIError) else internal_error(exc)
        yield frame(error_body(e.status, e.message, e.param, e.code))
        for event in after_error:
            yield event
