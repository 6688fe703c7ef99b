"""The line protocol of the peer scripts (``vllm_llm.py``, ``llama_cpp_llm.py``): run by the peer
virtualenv's python beside them (imported as a sibling module, standard library only), never by mstar.

The peer prints one JSON hello line (``{"ready": true, ...}``, or ``{"ready": false, "error"}`` when
it cannot start), then answers one JSON line per command line read from stdin until ``{"cmd":
"quit"}``; a command that fails is answered ``{"error"}`` and the peer goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

Answer = Callable[[dict], dict]


def answers_channel() -> TextIO:
    """The original stdout, for answers only; everything else that writes to fd 1 (the engine's own
    prints, its child processes) lands in stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def generation(generate: Callable[[list[list[int]], int], list[list[int]]], cmd: dict) -> dict:
    """The answer to a ``concurrent`` (every prompt in one ``generate`` call) or ``sequential`` (one
    call per prompt, in turn) command: ``{"wall_s", "request_s": [per request], "tokens": [[ids]]}``."""
    prompts, n = cmd["prompts"], int(cmd["max_tokens"])
    t0 = time.perf_counter()
    if cmd["cmd"] == "concurrent":
        tokens = generate(prompts, n)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "request_s": [wall] * len(prompts), "tokens": tokens}
    if cmd["cmd"] != "sequential":
        raise ValueError(f"unknown command {cmd['cmd']!r}")
    tokens, times = [], []
    for p in prompts:
        t = time.perf_counter()
        tokens += generate([p], n)
        times.append(time.perf_counter() - t)
    return {"wall_s": time.perf_counter() - t0, "request_s": times, "tokens": tokens}


def serve(out: TextIO, start: Callable[[], tuple[dict[str, Any], Answer]]) -> int:
    """``start()`` loads the peer and returns its hello line's fields and its command handler; then
    the command loop. The exit status."""
    try:
        hello, answer = start()
    except Exception as e:  # noqa: BLE001 - reported to the driver
        traceback.print_exc()
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        return 1
    print(json.dumps({"ready": True, **hello}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            ans = answer(cmd)
        except Exception as e:  # noqa: BLE001 - reported to the driver
            traceback.print_exc()
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), file=out, flush=True)
    return 0
