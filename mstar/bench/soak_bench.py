"""``mstar bench soak``: a bounded, mixed, concurrent load with hostile bodies, client disconnects and
aborts, then a leak audit.

Every request is one of ``KINDS``: chat (whole answer or streamed), speech, the native ``/generate``,
a hostile body that must get a 4xx, a stream the client drops after its first chunk (``disconnect``)
and a streamed request the client cancels at a random moment, maybe before any byte came back
(``abort``). Each ends with a label (``200``, ``404``, ``disconnected``, ``cancelled``,
``stream-error``, ``transport:ReadTimeout``...); a label its kind does not expect is an error.

Resources are sampled before the load and again once the server is idle: KV blocks in use, walks and
stream buffers (from ``Runtime.stats()``, summed over ranks), requests still running, shared-memory
files of the runtime (``/dev/shm/mstar-*``) and, per process of the server (this one, and each
worker process in process mode), open file descriptors, OS threads and RSS. Against a server
given by URL only what its ``/metrics`` shows (KV blocks, running requests) and /dev/shm are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from mstar.bench.net import free_port

KINDS = ("chat", "chat-stream", "speech", "generate", "hostile", "disconnect", "abort")
ROUTE_OF_KIND = {"chat": "chat", "chat-stream": "chat", "speech": "speech", "generate": "generate",
                 "disconnect": "chat", "abort": "generate"}
# 429 is the server refusing work while at --max-queue: intended, never a leak
EXPECTED = {"chat": {"200", "429"}, "chat-stream": {"200", "429"}, "speech": {"200", "429"},
            "generate": {"200", "429"}, "disconnect": {"disconnected", "200", "429"},
            "abort": {"cancelled", "200", "429"}}
WORDS = ("a soak test sends many small mixed requests while robots paint the sky and a cat listens to "
         "seven radios playing the same slow song").split()
SHM_DIR = "/dev/shm"
SHM_PREFIX = "mstar-"


@dataclass(frozen=True)
class Request:
    kind: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are
    cancel_after: float = 0.0  # abort: seconds before the client gives up


@dataclass
class Slack:
    """How much a resource may grow over a soak before it counts as a leak.

    Some pools are created on first use and then kept: uvicorn / anyio worker threads, torch's intra-op
    threads, the sockets of a connection pool. A warm-up request of every kind runs before the first
    sample so that most exist already; what is left is bounded by these numbers, none of which grows
    with the number of requests."""

    fds: int = 8
    threads: int = 8
    rss_mib: float = 64.0


# -- requests ---------------------------------------------------------------------------------------


def _prompt(rng: random.Random, lo: int = 2, hi: int = 10) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _chat(model: str, rng: random.Random, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": _prompt(rng)}],
            "max_tokens": rng.randint(1, max_tokens), "stream": stream}


def hostile_requests(model: str) -> list[Request]:
    """Bodies a server must refuse with a 4xx: malformed, out of range, unknown, undecodable."""
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "x"}]
    bad_image = [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}]}]
    bad_tensor = {"dtype": "int64", "shape": [3], "data": "AAAA"}
    bodies: list[tuple[str, Any]] = [
        (chat, b"{not json"),
        (chat, {"model": model, "messages": []}),
        (chat, {"model": "no-such-model", "messages": user}),
        (chat, {"model": model, "messages": user, "max_tokens": -5}),
        (chat, {"model": model, "messages": user, "max_tokens": 1 << 23}),
        (chat, {"model": model, "messages": 5}),
        (chat, {"model": model, "messages": bad_image}),
        (chat, {"model": model, "messages": user, "temperature": "hot"}),
        ("/v1/audio/speech", {"model": model, "input": "x", "voice": "no-such-voice"}),
        ("/generate", {"inputs": {"input_ids": bad_tensor}}),
        ("/generate", {"inputs": {"input_ids": {"dtype": "int64", "shape": [1 << 40], "data": ""}}}),
    ]
    return [Request("hostile", path, body) for path, body in bodies]


def build_request(kind: str, model: str, rng: random.Random, max_tokens: int) -> Request:
    """One request of ``kind``; the same seed gives the same requests."""
    if kind in ("chat", "chat-stream"):
        return Request(kind, "/v1/chat/completions", _chat(model, rng, max_tokens, kind == "chat-stream"))
    if kind == "disconnect":  # long enough to be running still when the client leaves
        body = _chat(model, rng, max_tokens, True)
        body["max_tokens"] = max_tokens * 4
        return Request(kind, "/v1/chat/completions", body)
    if kind == "speech":
        return Request(kind, "/v1/audio/speech", {"model": model, "input": _prompt(rng), "response_format": "pcm",
                                                  "stream_format": "audio", "max_tokens": rng.randint(1, max_tokens)})
    if kind in ("generate", "abort"):
        ids = [rng.randrange(3, 30) for _ in range(rng.randint(2, 12))]
        body = {"inputs": {"input_ids": ids}, "params": {"max_tokens": rng.randint(1, max_tokens * 2)}}
        return Request(kind, "/generate", body, cancel_after=rng.uniform(0.0, 0.05) if kind == "abort" else 0.0)
    if kind == "hostile":
        return rng.choice(hostile_requests(model))
    raise ValueError(f"unknown request kind {kind!r}; one of {', '.join(KINDS)}")


def expected(req: Request, label: str) -> bool:
    if req.kind == "hostile":
        return label.isdigit() and 400 <= int(label) < 500
    return label in EXPECTED[req.kind]


# -- sending --------------------------------------------------------------------------------------


def _stream_error(line: str) -> bool:
    """Whether an SSE / NDJSON line is an error event, or not an event at all."""
    if line.startswith("data: "):
        line = line[6:]
    if line == "[DONE]":
        return False
    try:
        event = json.loads(line)
    except ValueError:
        return True
    return not isinstance(event, dict) or "error" in event


async def _read_stream(r: httpx.Response, req: Request) -> str:
    if req.kind == "speech":
        async for _ in r.aiter_bytes():
            pass
        return "200"
    done = False
    async for line in r.aiter_lines():
        if not line.strip():
            continue
        if req.kind == "disconnect":
            return "disconnected"  # leaving the block closes the connection mid-stream
        if _stream_error(line):
            return "stream-error"
        done = line in ("data: [DONE]", '{"done": true}')
    return "200" if done else "truncated"


async def _streamed(client: httpx.AsyncClient, req: Request) -> str:
    async with client.stream("POST", req.path, json=req.body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        return await _read_stream(r, req)


async def send(client: httpx.AsyncClient, req: Request) -> str:
    """Send one request; the label it ended with."""
    try:
        if req.kind == "abort":
            try:
                return await asyncio.wait_for(_streamed(client, req), req.cancel_after)
            except TimeoutError:
                return "cancelled"
        if req.kind in ("chat", "hostile") and not (isinstance(req.body, dict) and req.body.get("stream")):
            kw = {"content": req.body, "headers": {"content-type": "application/json"}} \
                if isinstance(req.body, bytes) else {"json": req.body}
            r = await client.post(req.path, **kw)
            return str(r.status_code)
        return await _streamed(client, req)
    except httpx.HTTPError as e:
        return f"transport:{type(e).__name__}"


async def _drive(url: str, reqs: list[Request], concurrency: int, timeout: float,
                 headers: dict[str, str]) -> list[str]:
    labels: list[str] = [""] * len(reqs)
    todo = iter(range(len(reqs)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers, limits=limits) as client:
        async def worker() -> None:
            for i in todo:
                labels[i] = await send(client, reqs[i])

        await asyncio.gather(*[worker() for _ in range(min(concurrency, len(reqs)))])
    return labels


# -- resources ----------------------------------------------------------------------------------


def shm_files() -> set[str]:
    if not os.path.isdir(SHM_DIR):
        return set()
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}


def process_resources(pid: int) -> dict[str, float]:
    """Open file descriptors, OS threads and RSS (MiB) of a live process, from /proc."""
    out = {"fds": float(len(os.listdir(f"/proc/{pid}/fd")))}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "Threads":
                out["threads"] = float(value.split()[0])
            elif key == "VmRSS":
                out["rss_mib"] = int(value.split()[0]) / 1024
    return out


def runtime_counts(stats: dict[str, Any]) -> dict[str, int]:
    """What a request holds while it lives, summed over ranks: all 0 on an idle runtime."""
    ranks = stats["ranks"]
    return {"kv_blocks_used": sum(kv["blocks_used"] for r in ranks for kv in r["kv"].values()),
            "kv_swapped_requests": sum(kv.get("swapped_requests", 0) for r in ranks for kv in r["kv"].values()),
            "walks": sum(r["walks"] for r in ranks), "stream_buffers": sum(r["stream_buffers"] for r in ranks),
            "queued_items": sum(sum(r["queue_depth"].values()) for r in ranks),
            "running_requests": stats["running_requests"]}


def metrics_counts(url: str, headers: dict[str, str]) -> dict[str, int]:
    """The same counts as far as a server's /metrics shows them."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    sums: Counter[str] = Counter()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("mstar_kv_blocks_used", "mstar_running_requests", "mstar_kv_swapped_requests"):
            sums[name] += int(float(line.rsplit(" ", 1)[1]))
    return {"kv_blocks_used": sums["mstar_kv_blocks_used"], "running_requests": sums["mstar_running_requests"],
            "kv_swapped_requests": sums["mstar_kv_swapped_requests"]}


@dataclass
class Sampler:
    """Samples what a soak may leak: a ``runtime`` in this process, or a server's ``url``."""

    runtime: Any = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    engine: Any = None  # the Serving in front of ``runtime``: its admitted requests count too

    def pids(self) -> dict[str, int]:
        if self.runtime is None:
            return {}
        out = {"server": os.getpid()}
        for rank, p in enumerate(self.runtime.worker_processes or []):
            if p is not None and p.pid is not None:
                out[f"rank{rank}"] = p.pid
        return out

    def sample(self) -> dict[str, Any]:
        counts = runtime_counts(self.runtime.stats()) if self.runtime is not None else \
            metrics_counts(self.url or "", self.headers)
        if self.engine is not None:
            counts["server_in_flight"] = self.engine.in_flight
        return {"counts": counts, "shm_files": sorted(shm_files()),
                "processes": {name: process_resources(pid) for name, pid in self.pids().items()}}


def leaks(before: dict[str, Any], after: dict[str, Any], slack: Slack) -> list[str]:
    """Every way ``after`` (an idle server, after the load) is worse than ``before``; [] when none."""
    found = [f"{k} = {v} on an idle server" for k, v in after["counts"].items() if v]
    new_shm = sorted(set(after["shm_files"]) - set(before["shm_files"]))
    if new_shm:
        found.append(f"{len(new_shm)} new shared-memory file(s): {', '.join(new_shm[:5])}")
    for name, res in after["processes"].items():
        was = before["processes"].get(name)
        if was is None:
            continue  # e.g. a worker process restarted during the soak
        for key, allowed in (("fds", slack.fds), ("threads", slack.threads), ("rss_mib", slack.rss_mib)):
            grown = res.get(key, 0.0) - was.get(key, 0.0)
            if grown > allowed:
                found.append(f"{name}: {key} grew by {grown:g} (allowed {allowed:g})")
    return found


def settle(sampler: Sampler, before: dict[str, Any], slack: Slack, timeout: float) -> dict[str, Any]:
    """Poll until the server is idle and nothing leaks, or ``timeout`` runs out; the last sample.
    Aborts and disconnects are asynchronous: their blocks come back within a step or two."""
    deadline = time.monotonic() + timeout
    while True:
        after = sampler.sample()
        if not leaks(before, after, slack) or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


# -- the soak -------------------------------------------------------------------------------------


def plan(kinds: list[str], model: str, n: int, seed: int, max_tokens: int) -> list[Request]:
    rng = random.Random(seed)
    return [build_request(rng.choice(kinds), model, rng, max_tokens) for _ in range(n)]


def tally(reqs: list[Request], labels: list[str]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(labels per kind, unexpected labels as ``kind:label``)."""
    by_kind: dict[str, Counter[str]] = {}
    errors: Counter[str] = Counter()
    for req, label in zip(reqs, labels):
        by_kind.setdefault(req.kind, Counter())[label] += 1
        if not expected(req, label):
            errors[f"{req.kind}:{label}"] += 1
    return {k: dict(sorted(c.items())) for k, c in sorted(by_kind.items())}, dict(sorted(errors.items()))


def run_soak(url: str, model: str, requests: int, concurrency: int, *, kinds: list[str] | None = None,
             seed: int = 0, max_tokens: int = 16, engine: Any = None, api_key: str | None = None,
             timeout: float = 120.0, settle_s: float = 30.0, slack: Slack | None = None,
             warmup: bool = True) -> dict[str, Any]:
    """Soak the server at ``url`` (``engine``: its ``Serving``, in this process, for a full audit)."""
    kinds = list(kinds or KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad or requests < 1 or concurrency < 1:
        raise ValueError(f"kinds must be among {', '.join(KINDS)} (got {bad}); requests and concurrency >= 1")
    slack = slack or Slack()
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    sampler = Sampler(engine.runtime if engine is not None else None, url, headers, engine)
    if warmup:  # one of every kind first, so that pools created on first use exist before the first sample
        warm = [build_request(k, model, random.Random(seed), max_tokens) for k in kinds]
        asyncio.run(_drive(url, warm, 1, timeout, headers))
        settle(sampler, sampler.sample(), Slack(1 << 20, 1 << 20, 1e9), settle_s)
    before = sampler.sample()
    reqs = plan(kinds, model, requests, seed, max_tokens)
    t0 = time.perf_counter()
    labels = asyncio.run(_drive(url, reqs, concurrency, timeout, headers))
    duration = time.perf_counter() - t0
    after = settle(sampler, before, slack, settle_s)
    by_kind, errors = tally(reqs, labels)
    return {"url": url, "model": model, "requests": requests, "concurrency": concurrency, "seed": seed,
            "max_tokens": max_tokens, "kinds": kinds, "duration_s": duration,
            "requests_per_s": requests / duration if duration else 0.0, "labels": by_kind, "errors": errors,
            "before": before, "after": after, "leaks": leaks(before, after, slack)}


# -- an in-process server -------------------------------------------------------------------------


@contextlib.contextmanager
def serving(model: Any, name: str, *, max_queue: int = 256, start_timeout: float = 60.0,
            **runtime_kwargs: Any) -> Iterator[tuple[str, Any]]:
    """Serve ``model`` (a ``ModelDef`` or a registered name) on a free loopback port from a thread of
    this process; yields (base URL, Serving)."""
    import uvicorn

    from mstar.runtime.api import Runtime
    from mstar.server.app import create_app
    from mstar.server.serving import Serving

    runtime = Runtime(model, **runtime_kwargs).start()
    try:
        engine = Serving(runtime, name, max_queue)
        app = create_app(engine)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="mstar-soak-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the soak server did not start")
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}", engine
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    finally:
        runtime.shutdown()


def kinds_for(routes: frozenset[str] | set[str]) -> list[str]:
    """The request kinds a model serving ``routes`` can answer (hostile bodies fit every model)."""
    return [k for k in KINDS if k == "hostile" or ROUTE_OF_KIND[k] in routes]


def soak_in_process(model: Any, name: str, requests: int, concurrency: int, *, workers: str = "inline",
                    max_queue: int = 256, log: Callable[[str], None] | None = None,
                    **soak_kwargs: Any) -> dict[str, Any]:
    with serving(model, name, max_queue=max_queue, workers=workers) as (url, engine):
        if log:
            log(f"serving {name} ({workers} workers) on {url}")
        kinds = soak_kwargs.pop("kinds", None) or kinds_for(engine.adapter.routes)
        report = run_soak(url, name, requests, concurrency, kinds=kinds, engine=engine, **soak_kwargs)
    report["workers"] = workers
    return report


# -- the report ---------------------------------------------------------------------------------


def _resource_rows(report: dict[str, Any]) -> list[str]:
    before, after = report["before"], report["after"]
    rows = [f"| {k} | {before['counts'][k]} | {v} |" for k, v in after["counts"].items()]
    rows.append(f"| /dev/shm/{SHM_PREFIX}* files | {len(before['shm_files'])} | {len(after['shm_files'])} |")
    for proc, res in after["processes"].items():
        was = before["processes"].get(proc, {})
        for key in ("fds", "threads", "rss_mib"):
            fmt = "{:.1f}" if key == "rss_mib" else "{:.0f}"
            old = fmt.format(was[key]) if key in was else "-"
            rows.append(f"| {proc} {key.replace('_mib', ' MiB')} | {old} | {fmt.format(res.get(key, 0.0))} |")
    return rows


def format_report(report: dict[str, Any]) -> str:
    errors = sum(report["errors"].values())
    lines = [f"soak of {report['model']} at {report['url']}: {report['requests']} requests, concurrency "
             f"{report['concurrency']}, {report['duration_s']:.1f} s ({report['requests_per_s']:.1f} req/s), "
             f"{errors} error(s)", "", "| kind | outcomes |", "|---|---|"]
    for kind, labels in report["labels"].items():
        lines.append(f"| {kind} | " + ", ".join(f"{label} x{n}" for label, n in labels.items()) + " |")
    if report["errors"]:
        lines += ["", "errors: " + ", ".join(f"{k} x{n}" for k, n in report["errors"].items())]
    lines += ["", "| resource | before | after |", "|---|---|---|", *_resource_rows(report), ""]
    lines.append("leaks: " + ("; ".join(report["leaks"]) if report["leaks"] else "none"))
    return "\n".join(lines)


__all__ = ["KINDS", "Request", "Sampler", "Slack", "build_request", "format_report", "hostile_requests", "leaks",
           "run_soak", "serving", "soak_in_process"]
