"""The bridge between HTTP handlers and the runtime: admission control, streaming, aborts."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from mstar.model.adapter import ItemDecoder
from mstar.runtime.api import Runtime
from mstar.runtime.handles import RequestError, StreamItem
from mstar.server.errors import SHAPE_ERRORS, APIError, api_error, request_id
from mstar.server.metrics import ServerMetrics


class Serving:
    """The model served: its runtime, API adapter and metrics; submits, streams and aborts requests
    for the routes (``app.state.serving``)."""

    def __init__(self, runtime: Runtime, model_name: str, max_queue: int = 256) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.max_queue = max_queue
        self.adapter = runtime.model.api_adapter()
        self.metrics = ServerMetrics(model_name)
        self.metrics.install_runtime_collector(self._runtime_stats)
        self.in_flight = 0

    @property
    def ready(self) -> bool:
        return self.runtime.healthy

    def _runtime_stats(self) -> dict[str, Any]:
        if not self.ready:  # e.g. a worker restarting: its stats would only come once it is up
            raise RuntimeError(f"runtime is unhealthy: {self.runtime.unhealthy_reason}")
        return self.runtime.stats(timeout=5.0)

    def check_ready(self) -> None:
        if not self.ready:
            reason = self.runtime.unhealthy_reason or "starting"
            raise APIError(503, f"model {self.model_name} is not ready: {reason}")

    async def stream(self, route: str, inputs: dict[str, Any], params: Any,
                     decoder: ItemDecoder | None = None, trace: bool = True) -> AsyncIterator[StreamItem]:
        """Submit and stream items; when the request ends, ``decoder`` (of its items) gets the runtime's
        finish reason (``ItemDecoder.end``); ``trace`` False: the runtime keeps no walk trace of it (the
        server's own requests). A consumer that stops iterating aborts the request: a client
        gone, counted as aborted, or an answer the decoder ended early (a stop string), which is not."""
        self.check_ready()
        if self.in_flight >= self.max_queue:
            raise APIError(429, f"server is at capacity ({self.max_queue} requests in flight); retry later")
        try:
            label = request_id.get()  # the HTTP request's x-request-id: its trace's name (GET /v1/requests/{id}/trace)
            handle = self.runtime.submit(inputs, params, request_id=None if label == "-" else label, trace=trace)
        except (ValueError, RuntimeError, *SHAPE_ERRORS) as e:  # bad input 400, a runtime not serving 503
            raise api_error(e) from e
        self.in_flight += 1
        self.metrics.running.labels(self.model_name).inc()
        finished = False
        try:
            async for item in handle:
                yield item
            finished = True
            if decoder is not None:
                decoder.end(handle.result().finish_reason)
        except RequestError as e:
            finished = True
            raise api_error(e) from e
        finally:
            self.in_flight -= 1
            self.metrics.running.labels(self.model_name).dec()
            if not finished:
                if decoder is None or not decoder.done:
                    self.metrics.aborted.labels(self.model_name).inc()
                self.runtime.abort(handle.request_id)


class Timer:
    """Per-request latency bookkeeping for the metrics."""

    def __init__(self, metrics: ServerMetrics, route: str) -> None:
        self.m, self.route = metrics, route
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.first_audio = False

    def token(self, n: int = 1) -> None:
        now = time.perf_counter()
        labels = (self.m.model, self.route)
        if self.last is None:
            self.m.ttft.labels(*labels).observe(now - self.t0)
        else:
            self.m.itl.labels(*labels).observe(now - self.last)
        self.last = now
        self.m.tokens.labels(*labels).inc(n)

    def audio(self) -> None:
        if not self.first_audio:
            self.first_audio = True
            self.m.ttfa.labels(self.m.model, self.route).observe(time.perf_counter() - self.t0)

    def done(self, audio_seconds: float = 0.0) -> None:
        dt = time.perf_counter() - self.t0
        self.m.e2e.labels(self.m.model, self.route).observe(dt)
        if audio_seconds > 0:
            self.m.rtf.labels(self.m.model, self.route).observe(dt / audio_seconds)

