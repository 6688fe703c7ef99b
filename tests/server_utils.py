"""Run the HTTP server in a background thread on a free loopback port (tests only)."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from mstar.bench.net import free_port
from mstar.runtime.api import Runtime
from mstar.server.app import create_app
from mstar.server.serving import Serving


@contextlib.contextmanager
def running_server(model, name: str, *, api_key: str | None = None, max_queue: int = 64, **rt_kwargs):
    runtime = Runtime(model, **rt_kwargs).start()
    engine = Serving(runtime, name, max_queue)
    try:
        with running_app(create_app(engine, api_key=api_key)) as url:
            yield url, engine
    finally:
        runtime.shutdown()


def get(url: str, path: str, **kw) -> httpx.Response:
    return httpx.get(url + path, timeout=30, **kw)


@contextlib.contextmanager
def running_app(app):
    """Any ASGI app on a free loopback port, in a background thread."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
