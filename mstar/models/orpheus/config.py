"""Orpheus TTS's fixed vocabulary, prompt format and defaults, and the tiny LLM's config.

Prompt (as the reference): ``[128259] + tokenize(f"{voice}: {text}") + [128009, 128260, 128261,
128257]``; generation stops at token 128258 or after ``max_tokens``. Sampling defaults:
temperature 0.6, top_p 0.8, repetition_penalty 1.3, 1200 new tokens. Emotion tags such as
``<laugh>`` are plain text in the prompt. (Audio tokens and SNAC codes: ``codec.py``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar.layers.rotary import RopeScaling
from mstar.models.llama.config import LlamaConfig

__all__ = ["DEFAULT_SAMPLING", "END_OF_PROMPT", "MAX_NEW_TOKENS", "START_OF_HUMAN", "STOP_TOKEN", "TINY_LLM",
           "VOCAB_SIZE", "VOICES"]

START_OF_HUMAN = 128259
END_OF_PROMPT = (128009, 128260, 128261, 128257)
STOP_TOKEN = 128258
VOCAB_SIZE = 156940
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
DEFAULT_SAMPLING: Mapping[str, Any] = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3,
                                       "max_tokens": 1200}
MAX_NEW_TOKENS = 4096

TINY_LLM = LlamaConfig(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=1024),
    tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=128000, eos_token_id=STOP_TOKEN)
