"""``mstar bench serve``: an async load generator against a running server (ours or any
OpenAI-compatible one), in the shape of ``vllm bench serve``.

Each request is timed on the client: start, first token / first audio byte, every streamed
chunk, end. Per concurrency level (closed loop: N requests kept in flight) or request rate
(open loop: Poisson arrivals) it reports throughput and latency percentiles as a markdown table,
JSON and, optionally, a PNG plot.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

WORKLOADS = ("chat", "chat-image", "speech", "images", "generate")
WORDS = ("the quick brown fox jumps over a lazy dog while seven robots paint the morning sky in "
         "bright colours and a small cat listens to the radio").split()


@dataclass
class RequestResult:
    ok: bool
    start: float
    end: float
    first: float | None = None  # first token / first audio byte / first item
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    audio_s: float = 0.0
    images: int = 0
    error: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _png_data_url() -> str:
    # an 8x8 grey PNG, built without Pillow so the load generator has no imaging dependency
    import struct
    import zlib

    raw = b"".join(b"\x00" + b"\x80" * 24 for _ in range(8))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def build_request(workload: str, model: str, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of one request of ``workload``."""
    if workload in ("chat", "chat-image"):
        content: Any = _prompt(rng, rng.randint(4, 24))
        if workload == "chat-image":
            content = [{"type": "text", "text": content}, {"type": "image_url", "image_url": {"url": _png_data_url()}}]
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": content}],
                                        "max_tokens": max_tokens, "stream": True,
                                        "stream_options": {"include_usage": True}, "ignore_eos": True}
    if workload == "speech":
        return "/v1/audio/speech", {"model": model, "input": _prompt(rng, rng.randint(4, 16)), "stream_format": "audio",
                                    "response_format": "pcm", "max_tokens": max_tokens}
    if workload == "images":
        return "/v1/images/generations", {"model": model, "prompt": _prompt(rng, 8), "size": "64x64"}
    if workload == "generate":
        ids = [rng.randrange(3, 250) for _ in range(rng.randint(4, 24))]
        return "/generate", {"inputs": {"input_ids": ids}, "params": {"max_tokens": max_tokens}}
    raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")


async def run_one(client: httpx.AsyncClient, workload: str, path: str, body: dict,
                  sample_rate: int = 24000) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start, end=start)
    try:
        if workload == "images":
            r = await client.post(path, json=body)
            res.end = time.perf_counter()
            res.first = res.end
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            res.images = len(r.json().get("data", []))
            res.ok = True
            return res
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                res.end = time.perf_counter()
                return res
            if workload == "speech":
                n_bytes = 0
                async for data in r.aiter_bytes():
                    now = time.perf_counter()
                    if data:
                        res.first = res.first or now
                        res.chunk_times.append(now)
                        n_bytes += len(data)
                res.audio_s = n_bytes / 2 / sample_rate
            else:
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    _count_line(workload, line, now, res)
        res.end = time.perf_counter()
        res.ok = not res.error
    except httpx.HTTPError as e:
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"
    return res


def _count_line(workload: str, line: str, now: float, res: RequestResult) -> None:
    if workload == "generate":
        if not line.strip():
            return
        item = json.loads(line)
        if "error" in item:
            res.error = item["error"].get("message", "error")
        elif "name" in item:
            res.first = res.first or now
            res.chunk_times.append(now)
            res.tokens += 1
        return
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    payload = json.loads(line[6:])
    if "error" in payload:
        res.error = payload["error"].get("message", "error")
        return
    for choice in payload.get("choices", []):
        delta = choice.get("delta", {})
        if delta.get("content"):
            res.first = res.first or now
            res.chunk_times.append(now)
    if payload.get("usage"):
        res.tokens = payload["usage"].get("completion_tokens", res.tokens)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall: float, label: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.e2e for r in ok]
    tokens = sum(r.tokens for r in ok)
    audio = sum(r.audio_s for r in ok)
    rtf = [r.e2e / r.audio_s for r in ok if r.audio_s > 0]
    out: dict[str, Any] = {"label": label, "requests": len(results), "errors": len(results) - len(ok),
                           "wall_s": wall, "requests_per_s": len(ok) / wall if wall else 0.0,
                           "tokens_per_s": tokens / wall if wall else 0.0, "tokens": tokens,
                           "audio_s_per_s": audio / wall if wall else 0.0, "audio_s": audio,
                           "images_per_s": sum(r.images for r in ok) / wall if wall else 0.0}
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e), ("rtf", rtf)):
        for q in (50, 95, 99):
            v = _pct(vals, q)
            out[f"{name}_p{q}"] = v
    if results and not ok:
        out["first_error"] = results[0].error
    return out


async def _closed_loop(client, workload, model, n, concurrency, rng, max_tokens, progress) -> tuple[list, float]:
    requests = [build_request(workload, model, rng, max_tokens) for _ in range(n)]
    queue = list(enumerate(requests))
    results: list[RequestResult | None] = [None] * n

    async def worker():
        while queue:
            i, (path, body) = queue.pop(0)
            results[i] = await run_one(client, workload, path, body)
            progress()

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(min(concurrency, n))])
    return results, time.perf_counter() - t0


async def _open_loop(client, workload, model, n, rate, rng, max_tokens, progress) -> tuple[list, float]:
    async def one(delay, path, body):
        await asyncio.sleep(delay)
        r = await run_one(client, workload, path, body)
        progress()
        return r

    delays, t = [], 0.0
    for _ in range(n):
        delays.append(t)
        t += rng.expovariate(rate)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[one(d, *build_request(workload, model, rng, max_tokens)) for d in delays])
    return list(results), time.perf_counter() - t0


def run_serve_bench(url: str, workload: str, model: str, concurrency: list[int] | None = None,
                    request_rate: float | None = None, num_requests: int = 32, seed: int = 0,
                    max_tokens: int = 32, api_key: str | None = None, show_progress: bool = True,
                    timeout: float = 600.0) -> dict[str, Any]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    levels = concurrency or ([] if request_rate else [1])
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def main() -> list[dict]:
        out = []
        limits = httpx.Limits(max_connections=max(levels + [64]))
        async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers, limits=limits) as client:
            runs: list[tuple[str, Callable]] = [(f"concurrency {c}", lambda c=c: ("c", c)) for c in levels]
            if request_rate:
                runs.append((f"rate {request_rate}/s", lambda: ("r", request_rate)))
            for label, spec in runs:
                kind, value = spec()
                rng = random.Random(seed)
                done = [0]

                def progress(label=label, done=done):
                    done[0] += 1
                    if show_progress:
                        bar = "#" * int(30 * done[0] / num_requests)
                        print(f"\r{label:>16} [{bar:<30}] {done[0]}/{num_requests}", end="", file=sys.stderr,
                              flush=True)

                if kind == "c":
                    results, wall = await _closed_loop(client, workload, model, num_requests, value, rng,
                                                       max_tokens, progress)
                else:
                    results, wall = await _open_loop(client, workload, model, num_requests, value, rng,
                                                     max_tokens, progress)
                if show_progress:
                    print(file=sys.stderr)
                summary = summarize(results, wall, label)
                summary["concurrency" if kind == "c" else "request_rate"] = value
                out.append(summary)
        return out

    return {"url": url, "workload": workload, "model": model, "num_requests": num_requests, "seed": seed,
            "max_tokens": max_tokens, "results": asyncio.run(main())}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_table(report: dict[str, Any]) -> str:
    audio = report["workload"] == "speech"
    head = ("| run | req/s | " + ("audio-s/s | TTFA p50/p95/p99 ms | RTF p50 |" if audio else
                                 "tok/s | TTFT p50/p95/p99 ms | ITL p50/p95/p99 ms |")
            + " E2E p50/p95/p99 ms | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["results"]:
        lat = "/".join(_ms(r[f"ttft_p{q}"]) for q in (50, 95, 99))
        e2e = "/".join(_ms(r[f"e2e_p{q}"]) for q in (50, 95, 99))
        if audio:
            rtf = "-" if r["rtf_p50"] is None else f"{r['rtf_p50']:.3f}"
            mid = f"{r['audio_s_per_s']:.3f} | {lat} | {rtf} |"
        else:
            itl = "/".join(_ms(r[f"itl_p{q}"]) for q in (50, 95, 99))
            mid = f"{r['tokens_per_s']:.1f} | {lat} | {itl} |"
        lines.append(f"| {r['label']} | {r['requests_per_s']:.2f} | {mid} {e2e} | {r['errors']} |")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from e
    rows = [r for r in report["results"] if "concurrency" in r]
    if not rows:
        raise ValueError("--plot draws latency and throughput against concurrency: pass --concurrency")
    xs = [r["concurrency"] for r in rows]
    audio = report["workload"] == "speech"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    tput = [r["audio_s_per_s" if audio else "tokens_per_s"] or r["requests_per_s"] for r in rows]
    ax1.plot(xs, tput, marker="o")
    ax1.set(xlabel="concurrency", ylabel="audio-s/s" if audio else "tokens/s", title="throughput")
    for key, name in (("ttft_p50", "first token/audio p50"), ("e2e_p50", "end-to-end p50")):
        ax2.plot(xs, [(r[key] or 0) * 1000 for r in rows], marker="o", label=name)
    ax2.set(xlabel="concurrency", ylabel="ms", title="latency")
    ax2.legend()
    fig.suptitle(f"{report['model']} · {report['workload']}")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def dump_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


__all__ = ["RequestResult", "build_request", "dump_json", "format_table", "run_serve_bench", "summarize",
           "write_plot"]
