"""``LlamaConfig``: the architecture fields of a Hugging Face Llama ``config.json`` (or of a GGUF file's
metadata: ``llama_config_from_gguf``).

Both layouts transformers has written are read:

* transformers 5 stores RoPE in one ``rope_parameters`` dict
  (``{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}``);
* older checkpoints store ``rope_theta`` at top level and the schedule in ``rope_scaling``
  (``{"rope_type" | "type": "llama3", "factor": ..., ...}``, or null).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.layers.rotary import RopeScaling, parse_rope_scaling
from mstar.model.checkpoint import CheckpointError, CheckpointNotFoundError, listed
from mstar.model.gguf_file import GGUFFile, open_gguf
from mstar.model.validation import check_int

log = logging.getLogger(__name__)

__all__ = ["ROPE_FREQS", "TINY", "LlamaConfig", "gguf_eos_ids", "llama_config_from_gguf", "read_json"]

ROPE_FREQS = "rope_freqs.weight"  # a GGUF tensor of per-frequency RoPE factors (Llama 3.1 style): not supported

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return tuple(value)
    raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {what} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: = num_attention_heads (MHA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = field(default=(2,))  # an int or a list is accepted and normalised
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            check_int(getattr(self, name), f"LlamaConfig.{name}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                                 f"({self.num_attention_heads}); set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("num_key_value_heads", "head_dim"):
            check_int(getattr(self, name), f"LlamaConfig.{name}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for the rotary embedding, got {self.head_dim}")
        object.__setattr__(self, "eos_token_id", _token_ids(self.eos_token_id, "eos_token_id"))
        if self.bos_token_id is not None:
            bos = _token_ids(self.bos_token_id, "bos_token_id")
            object.__setattr__(self, "bos_token_id", bos[0] if bos else None)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            object.__setattr__(self, "rope_scaling",
                               parse_rope_scaling(self.rope_scaling, self.max_position_embeddings))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    # -- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
        """Parse an HF ``config.json`` dict (either RoPE layout); unknown keys are ignored."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: expected a mapping, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in (None, "llama"):
            log.warning("%s: model_type is %r, reading it as a Llama config", source, model_type)
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"{source}: missing required Llama config field(s) {missing}")
        max_pos = d.get("max_position_embeddings") or 2048
        rope = d.get("rope_parameters")
        if rope is None:
            rope = d.get("rope_scaling")
        rope = dict(rope or {})
        if rope and all(isinstance(v, Mapping) for v in rope.values()):
            raise ValueError(f"{source}: per-layer-type rope_parameters {sorted(rope)} are not supported "
                             f"for Llama")
        theta = rope.get("rope_theta")
        if theta is None:
            theta = d.get("rope_theta")
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported for Llama")
        try:
            scaling = parse_rope_scaling(rope, max_pos)
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads"),
                head_dim=d.get("head_dim"),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=10000.0 if theta is None else theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=max_pos,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                hidden_act=d.get("hidden_act", "silu"),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> LlamaConfig:
        """Read ``model_path/config.json``, or the metadata of ``model_path`` when it is a ``.gguf`` file."""
        if str(model_path).lower().endswith(".gguf"):
            return llama_config_from_gguf(model_path)
        path = Path(model_path)
        if not path.is_dir():
            raise CheckpointNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
        cfg = path / "config.json"
        if not cfg.is_file():
            raise CheckpointNotFoundError(f"no config.json in model path {str(path)!r}")
        return cls.from_hf_dict(read_json(cfg, "config.json"), source=str(cfg))

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-5 style ``config.json`` dict of this config (``rope_parameters`` layout)."""
        rope: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling is not None:
            rope = self.rope_scaling.to_dict()
        rope["rope_theta"] = self.rope_theta
        eos: Any = list(self.eos_token_id)
        if len(eos) == 1:
            eos = eos[0]
        elif not eos:
            eos = None
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
        }


# Tiny Llama for tests and offline serving: GQA (4 query / 2 KV heads), llama3 RoPE scaling whose
# three frequency bands all occur at head_dim 16 (wavelengths 6 and 20 kept, 63 blended, >= 199
# scaled), tied embeddings. Token ids fit the ByteTokenizer (pad 0, bos 1, eos 2, bytes 3..258).
TINY = LlamaConfig(
    vocab_size=259,  # exactly the byte tokenizer: every generated id decodes to a byte
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=128),
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=(2,),
)


# -- GGUF metadata ----------------------------------------------------------------------------------------
def _int_field(meta: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int | None:
    value = meta.get(key, default)
    if isinstance(value, list):
        raise CheckpointError(f"{source}: {key} is per layer ({value[:4]}...); only one value for every "
                              f"layer is supported for Llama")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise CheckpointError(f"{source}: {key} must be an int, got {value!r}")
    return value


def _rope_scaling(meta: Mapping[str, Any], arch: str, source: str, max_pos: int) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise CheckpointError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported "
                              f"(only 'none' and 'linear')")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        raise CheckpointError(f"{source}: linear rope scaling without {arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length", max_pos)
    return RopeScaling("linear", float(factor), original_max_position_embeddings=original)


def gguf_eos_ids(gf: GGUFFile) -> tuple[int, ...]:
    """The ids generation stops on: the EOS token, and the end-of-turn / end-of-message ones if named."""
    ids = [gf.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool)))


def llama_config_from_gguf(path: str | Path | GGUFFile) -> LlamaConfig:
    """The ``LlamaConfig`` a GGUF file's metadata describes (``general.architecture`` must be llama)."""
    gf = path if isinstance(path, GGUFFile) else open_gguf(path)
    meta, source, arch = gf.metadata, gf.path.name, gf.architecture
    if arch != "llama":
        raise CheckpointError(f"{source}: general.architecture is {arch!r}; the llama family loads only "
                              f"'llama' GGUF files")
    if ROPE_FREQS in gf.tensor_names:
        raise CheckpointError(f"{source}: tensor {ROPE_FREQS} (per-frequency RoPE factors, Llama 3.1 "
                              f"style) is not supported")
    required = {k: _int_field(meta, f"{arch}.{k}", source) for k in
                ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")}
    missing = [f"{arch}.{k}" for k, v in required.items() if v is None]
    if missing:
        raise CheckpointError(f"{source}: missing Llama metadata {listed(missing)}")
    heads = required["attention.head_count"]
    head_dim = _int_field(meta, f"{arch}.attention.key_length", source)
    rot = _int_field(meta, f"{arch}.rope.dimension_count", source)
    head_dim = head_dim or rot or required["embedding_length"] // heads
    if rot is not None and rot != head_dim:
        raise CheckpointError(f"{source}: rope.dimension_count {rot} != head dim {head_dim} "
                              f"(partial rotary embeddings are not supported)")
    vocab = _int_field(meta, f"{arch}.vocab_size", source)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else gf.shape("token_embd.weight")[0]
    max_pos = _int_field(meta, f"{arch}.context_length", source, 2048)
    eos = gguf_eos_ids(gf)
    try:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=required["embedding_length"],
            intermediate_size=required["feed_forward_length"], num_hidden_layers=required["block_count"],
            num_attention_heads=heads,
            num_key_value_heads=_int_field(meta, f"{arch}.attention.head_count_kv", source, heads),
            head_dim=head_dim, rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=_rope_scaling(meta, arch, source, max_pos),
            tie_word_embeddings="output.weight" not in gf.tensor_names, max_position_embeddings=max_pos,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=eos or None)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e
