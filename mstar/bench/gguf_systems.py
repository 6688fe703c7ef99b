"""The files and the llama.cpp system of ``mstar bench compare gguf`` (``gguf_bench.py``): the Q8_0 / F16
conversions of SmolLM2's Q4_1 file, its chat prompts, and ``LlamaCppSystem``, which drives
``peers/llama_cpp_llm.py`` in the peer virtualenv."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.bench.llm_shape import default_cache_dir
from mstar.bench.llm_systems import PeerUnavailable, Run, _tail, peer_python

__all__ = ["LLAMA_CPP_SCRIPT", "QUESTIONS", "LlamaCppSystem", "chat_prompts", "convert", "gguf_files"]

LLAMA_CPP_SCRIPT = Path(__file__).with_name("peers") / "llama_cpp_llm.py"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence.",
    "Name three primary colors.", "How do I boil an egg?", "What is a prime number?",
    "Give me a short tip for learning to code.", "Why is the sky blue?", "Summarize the plot of Cinderella.",
    "What does a CPU do?", "Translate 'good morning' into Spanish.", "List four planets of the solar system.",
    "What is photosynthesis?", "Suggest a name for a pet turtle.", "How many legs does a spider have?",
    "Describe a rainy day in two sentences.",
]


# -- files --------------------------------------------------------------------------------------------------
def _copy_metadata(reader: Any, writer: Any, gguf: Any, file_type: int) -> None:
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = file_type if key == "general.file_type" else f.contents()
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)


def convert(source: Path, target: Path, kind: str) -> Path:
    """``source`` re-written with every matrix as ``kind`` (``Q8_0`` or ``F16``) by the ``gguf`` package."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    file_type = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "F16": gguf.LlamaFileType.MOSTLY_F16}[kind]
    _copy_metadata(reader, writer, gguf, int(file_type))
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if values.ndim < 2:
            writer.add_tensor(t.name, values)
        elif kind == "F16":
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(target)
    return target


def gguf_files(cache_dir: str | Path | None = None, log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """``{"q4_1", "q8_0", "f16"}`` -> the file; the two conversions written once per source file."""
    from mstar.models.llama.smollm2 import packaged_gguf

    source = packaged_gguf()
    st = source.stat()
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    folder = folder / f"smollm2-gguf-{st.st_size}-{int(st.st_mtime)}"
    folder.mkdir(parents=True, exist_ok=True)
    files = {"q4_1": source}
    for kind in ("Q8_0", "F16"):
        path = folder / f"SmolLM2-135M-Instruct.{kind}.gguf"
        if not path.is_file():
            if log:
                log(f"writing {path.name} with the gguf package")
            convert(source, path, kind)
        files[kind.lower()] = path
    return files


def chat_prompts(n: int) -> list[list[int]]:
    """The first ``n`` of ``QUESTIONS`` as SmolLM2 chat prompts (its template and default system prompt)."""
    from mstar.models.llama.smollm2 import SmolLM2

    if n > len(QUESTIONS):
        raise ValueError(f"at most {len(QUESTIONS)} prompts")
    adapter = SmolLM2().api_adapter()
    return [adapter.chat_request({"messages": [{"role": "user", "content": q}]}, [], []).inputs["input_ids"][0].tolist()
            for q in QUESTIONS[:n]]


# -- llama.cpp ---------------------------------------------------------------------------------------------
class LlamaCppSystem:
    """Drives ``peers/llama_cpp_llm.py`` in the peer virtualenv, one JSON line each way."""

    def __init__(self, name: str, path: Path, venv: str | Path | None, max_num_seqs: int, threads: int,
                 log_dir: Path) -> None:
        py = peer_python(venv)
        check = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True, text=True)
        if check.returncode != 0:
            raise PeerUnavailable("llama.cpp skipped: llama-cpp-python is not in the peer virtualenv "
                                  "(`make bench-peers` builds it)")
        self.name = name
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        self.log_path = log_dir / f"{name}-peer.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(py), str(LLAMA_CPP_SCRIPT), "--model", str(path), "--max-num-seqs",
                                      str(max_num_seqs), "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise PeerUnavailable(f"llama.cpp failed to start: {hello.get('error')} (log: {self.log_path})")
        self.version, self.system = hello["llama_cpp"], hello["system"]
        self.model_bytes, self.rss_load_kib = hello["model_bytes"], hello["rss_load_kib"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise PeerUnavailable(f"the llama.cpp peer exited (code {code}); see {self.log_path}:\n" + _tail(self.log_path))
        return json.loads(line)

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        ans = self._read()
        if "error" in ans:
            raise RuntimeError(f"{self.name}: {ans['error']}")
        return ans

    def _run(self, mode: str, prompts: list[list[int]], max_tokens: int) -> Run:
        ans = self._ask({"cmd": mode, "prompts": prompts, "max_tokens": max_tokens})
        return Run(ans["wall_s"], ans["tokens"], ans["request_s"])

    def concurrent(self, prompts: list[list[int]], max_tokens: int) -> Run:
        return self._run("concurrent", prompts, max_tokens)

    def sequential(self, prompts: list[list[int]], max_tokens: int) -> Run:
        return self._run("sequential", prompts, max_tokens)

    def logits(self, prompt: list[int], out: Path) -> torch.Tensor:
        self._ask({"cmd": "logits", "prompt": prompt, "out": str(out)})
        return torch.from_numpy(np.load(out))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
