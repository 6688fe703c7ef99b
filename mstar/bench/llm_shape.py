"""The Llama shape ``mstar bench compare llm`` (and the engine and runtime probes) measure, and where the
benchmarks cache the checkpoints they write."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BENCH_SHAPE", "LlmShape", "default_cache_dir"]


@dataclass(frozen=True)
class LlmShape:
    """The benchmark's Llama shape (the issue's: a step is real work on a CPU)."""

    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 32000
    max_position_embeddings: int = 2048

    def hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "hidden_act": "silu", "torch_dtype": "float32",
        }

    def tag(self) -> str:
        return (f"llama-h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}"
                f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-d{self.head_dim}-v{self.vocab_size}")


BENCH_SHAPE = LlmShape()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mstar" / "bench"
