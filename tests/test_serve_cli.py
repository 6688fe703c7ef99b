"""`mstar serve` as a user runs it: a separate process with worker processes; SIGTERM exits cleanly
and leaves no orphan. Plus a bounded schemathesis run over /openapi.json: no 5xx."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server_utils import free_port

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(x) for x in (task / "children").read_text().split()}
    return out


@pytest.mark.slow
def test_serve_sigterm_exits_cleanly_without_orphans():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli.main", "serve", "tests.toy_server_models:ToyChat",
                             "--port", str(port), "--served-model-name", "toy-chat", "--workers", "process"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"model": "toy-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
        workers = _children(proc.pid)
        assert workers, "expected worker processes"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "serving toy-chat on http://127.0.0.1" in out
        # children (workers, multiprocessing's resource tracker) exit on their own shortly after
        deadline = time.monotonic() + 15
        alive = workers
        while alive and time.monotonic() < deadline:
            alive = {p for p in alive if Path(f"/proc/{p}").exists()
                     and "zombie" not in Path(f"/proc/{p}/status").read_text()}
            time.sleep(0.1)
        assert not alive, [Path(f"/proc/{p}/cmdline").read_bytes() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_openapi_fuzz_finds_no_5xx():
    """Schemathesis generates requests for every operation of /openapi.json (bounded per operation)."""
    from hypothesis import given

    from mstar.runtime.api import Runtime
    from mstar.server.app import create_app
    from mstar.server.serving import Serving
    from tests.toy_server_models import ToyChat

    rt = Runtime(ToyChat()).start()
    try:
        app = create_app(Serving(rt, "toy-chat", 64))
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        checked = []
        for result in schema.get_all_operations():
            op = result.ok()

            @given(case=op.as_strategy())
            @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = "toy-chat"  # reach the route's logic, not the unknown-model 404
                response = case.call()
                assert response.status_code < 500, \
                    f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"

            check()
            checked.append(f"{op.method.upper()} {op.path}")
        assert "POST /v1/chat/completions" in checked and "POST /generate" in checked
    finally:
        rt.shutdown()
