"""Llama (HF ``LlamaForCausalLM`` checkpoints) as a prefill/decode Walk Graph; ``llama-tiny`` runs offline."""

from mstar.models.llama.config import TINY, LlamaConfig
from mstar.models.llama.graph import LlamaLM, LlamaTiny

__all__ = ["TINY", "LlamaConfig", "LlamaLM", "LlamaTiny"]
