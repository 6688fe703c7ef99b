"""The ``smollm2`` model of ``mstar bench compare llm``: SmolLM2-135M-Instruct as an fp32 safetensors directory.

HF transformers and vLLM read safetensors checkpoints, not mstar's GGUF loader, so the packaged
GGUF file is dequantized once (q/k rows back in transformers' order, the same values mstar's GGUF
loader produces) into a Hugging Face layout directory: ``config.json`` (``LlamaForCausalLM``, fp32,
tied embeddings, so no ``lm_head.weight``) and ``model.safetensors``. Every system of the
comparison then reads that directory, as they read the random-weight checkpoint of the default model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from mstar.bench.llm_shape import LlmShape, default_cache_dir
from mstar.model.gguf_file import open_gguf
from mstar.models.llama.config import llama_config_from_gguf
from mstar.models.llama.gguf_loader import hf_tensors

__all__ = ["ensure_smollm2_checkpoint", "smollm2_shape"]

_SOURCE = "source.json"  # which GGUF file (name, size, mtime) the directory was written from


def smollm2_shape(model_path: str | Path) -> LlmShape:
    """The model's shape (for the prompts' vocabulary and the report), from the GGUF file's metadata or the
    written directory's config.json."""
    from mstar.models.llama.config import LlamaConfig

    c = LlamaConfig.from_pretrained(model_path)
    return LlmShape(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                    max_position_embeddings=c.max_position_embeddings)


def _stamp(gguf_path: Path) -> dict:
    st = gguf_path.stat()
    return {"file": gguf_path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def ensure_smollm2_checkpoint(cache_dir: str | Path | None = None, gguf_path: str | Path | None = None,
                              log: Callable[[str], None] | None = None) -> Path:
    """The fp32 HF-layout directory of ``gguf_path`` (default: the packaged SmolLM2 file), written on first
    use under ``cache_dir`` and reused while the GGUF file is unchanged."""
    from safetensors.torch import save_file

    if gguf_path is None:
        from mstar.models.llama.smollm2 import packaged_gguf

        gguf_path = packaged_gguf()
    gguf_path = Path(gguf_path)
    path = Path(cache_dir or default_cache_dir()) / f"{gguf_path.stem}-fp32"
    stamp = _stamp(gguf_path)
    source = path / _SOURCE
    if source.is_file() and (path / "model.safetensors").is_file() and json.loads(source.read_text()) == stamp:
        return path
    if log:
        log(f"writing {gguf_path.name} dequantized to fp32 safetensors in {path}")
    gf = open_gguf(gguf_path)
    config = llama_config_from_gguf(gf)
    state = {hf: tensor.contiguous() for _, hf, tensor in hf_tensors(gf, config)}
    # rope_theta at top level too: the layout older transformers (a peer's) reads
    hf_config = {**config.to_hf_dict(), "rope_theta": config.rope_theta, "torch_dtype": "float32"}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
    (tmp / _SOURCE).write_text(json.dumps(stamp))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path
