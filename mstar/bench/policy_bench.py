"""``mstar bench compare policy``: pi0.5 served by mstar over openpi's websocket protocol against
lerobot's ``PI05Pytorch.sample_actions`` called one request at a time, same weights, same inputs.

Two model sizes (``BENCH_CONFIGS``), both with 3 cameras, 48 prompt tokens and 10 flow steps:
``medium`` (112 px images -> 192 image tokens, a 4-layer 256-wide prefix LLM, a 4-layer 128-wide
expert) and ``small`` (56 px -> 48 image tokens, 2-layer 128-wide prefix, 2-layer 64-wide expert). Their
weights are written once by the reference (seeded, lerobot's key names) into ``--cache-dir`` and
loaded by both sides. mstar runs as ``mstar serve`` does (a worker process, the FastAPI app with
the policy route); each client is a thread with its own websocket connection that sends its
observations one after the other (closed loop), as robots do. The reference runs in its own
virtualenv (``make ref-pi05``) with no server around it, so its latency is the model call alone,
while mstar's includes msgpack, the websocket, input processing and the runtime.

Reported per system and concurrency: action chunks/s and actions/s (chunks x horizon), latency
p50 / p95, and the largest difference between mstar's and the reference's actions for the same
requests (same noise), which shows both compute the same policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mstar.bench import harness
from mstar.bench.net import free_port
from mstar.models.pi05 import inputs as pi
from mstar.models.pi05.config import GemmaConfig, Pi05Config, VisionConfig

REF_VENV = ".venv-ref-pi05"
PEER_SCRIPT = Path(__file__).with_name("peers") / "pi05_lerobot.py"
SHIM_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "pi05"
# Two sizes: on one CPU thread "medium" is compute-bound (batching saves little arithmetic), while
# "small" is dominated by per-operation overhead, the regime a GPU is in at batch 1.
BENCH_CONFIGS = {
    "medium": Pi05Config(
        vision=VisionConfig(hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4, image_size=112),
        prefix=GemmaConfig(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
        expert=GemmaConfig(width=128, depth=4, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
        vocab_size=1024),
    "small": Pi05Config(
        vision=VisionConfig(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=2, image_size=56),
        prefix=GemmaConfig(width=128, depth=2, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=64, depth=2, mlp_dim=256, num_heads=8, num_kv_heads=1, head_dim=16),
        vocab_size=1024),
}


class ReferenceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class BenchRequest:
    """One observation: uint8 [H, W, 3] per camera slot, the prompt's token ids, the flow's noise."""

    cameras: dict[str, np.ndarray]
    token_ids: np.ndarray
    noise: np.ndarray


@dataclass
class LoadResult:
    system: str
    concurrency: int
    latencies: list[float]
    wall_s: float
    horizon: int

    @property
    def chunks_per_s(self) -> float:
        return len(self.latencies) / self.wall_s

    @property
    def actions_per_s(self) -> float:
        return self.chunks_per_s * self.horizon

    def percentile(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def make_requests(cfg: Pi05Config, n: int, text_tokens: int = 48, seed: int = 0) -> list[BenchRequest]:
    g = np.random.default_rng(seed)
    side = cfg.vision.image_size
    out = []
    for _ in range(n):
        cams = {slot: g.integers(0, 256, (side, side, 3), dtype=np.uint8) for slot in pi.CAMERA_SLOTS}
        ids = g.integers(3, cfg.vocab_size, text_tokens).astype(np.int64)
        ids[0] = pi.BOS_ID
        noise = g.standard_normal((cfg.horizon, cfg.action_dim)).astype(np.float32)
        out.append(BenchRequest(cams, ids, noise))
    return out


def _sizes(cfg: Pi05Config) -> dict:
    def gemma(c: GemmaConfig) -> dict:
        return {"width": c.width, "depth": c.depth, "mlp_dim": c.mlp_dim, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}

    v = cfg.vision
    return {"gemma_2b": gemma(cfg.prefix), "gemma_300m": gemma(cfg.expert), "vocab": cfg.vocab_size,
            "image": v.image_size, "vision": {"hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
                                              "num_layers": v.num_layers, "num_heads": v.num_heads}}


# -- the reference ---------------------------------------------------------------------------------


def reference_python(venv: str | Path | None = None) -> Path:
    py = (Path(venv) if venv else Path.cwd() / REF_VENV) / "bin" / "python"
    if not py.is_file():
        raise ReferenceUnavailable(f"no reference virtualenv at {venv or REF_VENV} (run `make ref-pi05`)")
    if not (SHIM_DIR / "pi05_ref_shim.py").is_file():
        raise ReferenceUnavailable(f"the reference import shim is missing ({SHIM_DIR}): run from a repository checkout")
    return py


class ReferencePolicy:
    """lerobot's model in a process of the reference virtualenv, built once; ``run`` times a list
    of requests there, one at a time."""

    def __init__(self, cfg: Pi05Config, checkpoint: Path, venv: str | Path | None = None,
                 threads: int | None = None) -> None:
        self.cfg = cfg
        self._tmp = tempfile.TemporaryDirectory()
        job = {"sizes": _sizes(cfg), "checkpoint": str(checkpoint), "shim_dir": str(SHIM_DIR), "seed": 0}
        if threads:
            job["threads"] = threads
        job_file = Path(self._tmp.name) / "job.json"
        job_file.write_text(json.dumps(job))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the reference never sees mstar
        self._log = open(Path(self._tmp.name) / "stderr.log", "w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(reference_python(venv)), str(PEER_SCRIPT), str(job_file)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        hello = self._answer()
        self.desc = f"{hello['reference']}, {hello['threads']} thread(s)"

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            self._log.seek(0)
            raise RuntimeError(f"the reference exited ({self.proc.returncode}):\n{self._log.read()[-3000:]}")
        return json.loads(line)

    def run(self, reqs: list[BenchRequest], warmup: int = 0) -> tuple[LoadResult, np.ndarray]:
        """(timings, actions [N, horizon, action_dim])."""
        from safetensors.numpy import load_file
        from safetensors.torch import save_file

        tmp = Path(self._tmp.name)
        save_file(reference_inputs(self.cfg, reqs), str(tmp / "inputs.safetensors"))
        cmd = {"inputs": str(tmp / "inputs.safetensors"), "actions_out": str(tmp / "actions.safetensors"),
               "warmup": warmup}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        seconds = self._answer()["seconds"]
        actions = load_file(cmd["actions_out"])["actions"]
        return LoadResult("lerobot", 1, seconds, sum(seconds), self.cfg.horizon), actions

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> ReferencePolicy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reference_inputs(cfg: Pi05Config, reqs: list[BenchRequest]) -> dict[str, torch.Tensor]:
    """The requests as the reference's ``sample_actions`` takes them (images processed as mstar does)."""
    side = cfg.vision.image_size
    cams = [pi.prepare_cameras({k: torch.from_numpy(v) for k, v in r.cameras.items()}, side, side) for r in reqs]
    return {"images": torch.stack([c.images for c in cams]), "img_masks": torch.stack([c.mask for c in cams]),
            "tokens": torch.from_numpy(np.stack([r.token_ids for r in reqs])),
            "masks": torch.ones(len(reqs), len(reqs[0].token_ids), dtype=torch.bool),
            "noise": torch.from_numpy(np.stack([r.noise for r in reqs]))}


def ensure_checkpoint(cfg: Pi05Config, directory: Path, venv: str | Path | None = None) -> Path:
    """The bench weights (lerobot key names), written once by the reference."""
    if not (directory / "model.safetensors").is_file():
        ReferencePolicy(cfg, directory, venv).close()
    return directory


# -- mstar over the websocket policy route -------------------------------------------------------


def _observation(r: BenchRequest) -> dict:
    return {"image": dict(r.cameras), "token_ids": r.token_ids, "noise": r.noise}


def _client(url: str, reqs: list[BenchRequest], latencies: list[float], actions: dict[int, np.ndarray],
            offset: int, start: threading.Barrier) -> None:
    from websockets.sync.client import connect

    from mstar.server import policy_wire

    with connect(url, compression=None, max_size=None) as ws:
        policy_wire.unpack(ws.recv())  # metadata
        start.wait()
        for i, r in enumerate(reqs):
            t0 = time.perf_counter()
            ws.send(policy_wire.pack(_observation(r)))
            reply = ws.recv()
            latencies.append(time.perf_counter() - t0)
            if isinstance(reply, str):
                raise RuntimeError(f"policy server error: {reply}")
            actions[offset + i] = np.array(policy_wire.unpack(reply)["actions"])


def load(url: str, reqs: list[BenchRequest], concurrency: int, per_client: int, horizon: int
         ) -> tuple[LoadResult, dict[int, np.ndarray]]:
    """``concurrency`` connections, each sending ``per_client`` observations back to back."""
    latencies: list[float] = []
    actions: dict[int, np.ndarray] = {}
    start = threading.Barrier(concurrency + 1)
    threads = []
    for c in range(concurrency):
        mine = [reqs[(c * per_client + i) % len(reqs)] for i in range(per_client)]
        threads.append(threading.Thread(target=_client, args=(url, mine, latencies, actions, c * per_client, start)))
        threads[-1].start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(latencies) != concurrency * per_client:
        raise RuntimeError(f"only {len(latencies)} of {concurrency * per_client} observations were answered")
    return LoadResult("mstar", concurrency, latencies, wall, horizon), actions


@contextlib.contextmanager
def mstar_policy(cfg: Pi05Config, checkpoint: Path | None, workers: str = "process", threads: int = 1):
    """mstar serving ``cfg`` (the checkpoint's weights, or dummy ones): yields the policy's ws:// URL."""
    from mstar.models.pi05.model import Pi05Model
    from mstar.runtime.api import Runtime
    from mstar.server.app import create_app
    from mstar.server.serving import Serving

    model = Pi05Model(model_path=checkpoint, load_format="auto" if checkpoint else "dummy", config=cfg)
    with _threads(threads), Runtime(model, workers=workers) as runtime, \
            _serving(create_app(Serving(runtime, "pi05"))) as url:
        yield url


def run_mstar(cfg: Pi05Config, checkpoint: Path | None, reqs: list[BenchRequest], concurrencies: list[int],
              per_client: int, workers: str = "process", threads: int = 1) -> tuple[list[LoadResult], np.ndarray]:
    """(one result per concurrency, the actions of ``reqs`` answered one at a time)."""
    with mstar_policy(cfg, checkpoint, workers, threads) as url:
        load(url, reqs, 1, 3, cfg.horizon)  # warm up
        _, first = load(url, reqs, 1, len(reqs), cfg.horizon)
        results = [load(url, reqs, c, per_client if c > 1 else len(reqs), cfg.horizon)[0] for c in concurrencies]
    return results, np.stack([first[i] for i in range(len(reqs))])


@contextlib.contextmanager
def _threads(n: int):
    """Worker processes started inside take ``n`` torch threads (they read OMP_NUM_THREADS at start)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = before


class _serving:
    """The app on a free loopback port in a background thread (as ``mstar serve`` runs it)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))

    def __enter__(self) -> str:
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the policy server did not start")
            time.sleep(0.01)
        return f"ws://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# -- the comparison ------------------------------------------------------------------------------


@dataclass
class PolicyCompare:
    reference: LoadResult
    mstar: list[LoadResult]
    max_abs_diff: float
    reference_desc: str
    rounds: int = 1
    compared: int = 0  # requests whose actions were compared


def run_policy_compare(concurrencies: list[int], size: str = "medium", requests: int = 16, per_client: int = 8,
                       rounds: int = 3, cache_dir: str | Path | None = None, venv: str | Path | None = None,
                       threads: int = 1) -> PolicyCompare:
    """``rounds`` rounds through the harness, each: the reference over ``requests`` observations and
    mstar at every concurrency, in an order that rotates per round; a system's figures pool its
    rounds. Alternating keeps a shared machine's changing load from favouring one side. Both sides get ``threads`` torch threads (default 1: with more
    threads than idle cores, timings on a shared machine swing by several times)."""
    cfg = BENCH_CONFIGS[size]
    cache = (Path(cache_dir) if cache_dir else Path.home() / ".cache" / "mstar" / "bench") / f"pi05-{size}"
    checkpoint = ensure_checkpoint(cfg, cache, venv)
    reqs = make_requests(cfg, requests)
    with ReferencePolicy(cfg, checkpoint, venv, threads) as ref, mstar_policy(cfg, checkpoint, threads=threads) as url:
        systems = ["reference", *concurrencies]

        def one(system, _r):
            if system == "reference":
                return ref.run(reqs)
            return load(url, reqs, system, per_client if system > 1 else len(reqs), cfg.horizon)

        def warm_up(system) -> None:
            if system == "reference":
                ref.run(reqs[:3], warmup=3)
            elif system == systems[1]:  # one warm-up of the server serves every client count
                load(url, reqs, 1, 3, cfg.horizon)

        per = harness.rotate(systems, one, rounds, warmup=warm_up)
        desc = ref.desc
    refs = [timing for timing, _ in per["reference"]]
    ours = {c: [result for result, _ in per[c]] for c in concurrencies}
    ref_actions = per["reference"][-1][1]
    if 1 in concurrencies:
        actions = per[1][-1][1]
        our_actions = np.stack([actions[i] for i in range(len(reqs))])
    else:
        raise ValueError("the action comparison needs the 1-client run: include 1 in concurrencies")
    diff = float(np.abs(our_actions - ref_actions).max())
    return PolicyCompare(_pooled(refs), [_pooled(ours[c]) for c in concurrencies], diff, desc, rounds, len(reqs))


def _pooled(results: list[LoadResult]) -> LoadResult:
    first = results[0]
    return LoadResult(first.system, first.concurrency, [x for r in results for x in r.latencies],
                      sum(r.wall_s for r in results), first.horizon)


def format_compare(res: PolicyCompare) -> str:
    ref = res.reference
    lines = [f"reference: {res.reference_desc}; one request at a time; {res.rounds} alternating round(s)",
             f"max |mstar - reference| over the actions of {res.compared} requests: {res.max_abs_diff:.2e}",
             "",
             "| system | concurrent clients | chunks/s | actions/s | p50 ms | p95 ms | vs reference (throughput) |",
             "|---|---|---|---|---|---|---|",
             _row(ref, "1 (serial)", ref)]
    lines += [_row(r, str(r.concurrency), ref) for r in res.mstar]
    return "\n".join(lines)


def _row(r: LoadResult, clients: str, ref: LoadResult) -> str:
    return (f"| {r.system} | {clients} | {r.chunks_per_s:.2f} | {r.actions_per_s:.0f} | "
            f"{r.percentile(50) * 1000:.1f} | {r.percentile(95) * 1000:.1f} | "
            f"{r.chunks_per_s / ref.chunks_per_s:.2f}x |")
