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
