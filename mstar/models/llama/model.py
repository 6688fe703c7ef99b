"""``LlamaLM``: a Hugging Face Llama checkpoint served as the prefill + decode walks of ``graph.py``;
``LlamaTiny``, its offline twin.

Request parameters (``params``):

* ``max_tokens``: new tokens to generate (overrides ``sampling.max_tokens``; default 16);
* ``sampling``: ``SamplingParams`` fields (temperature, top_k, top_p, repetition_penalty, seed,
  stop_token_ids, ignore_eos, max_tokens); default greedy (temperature 0).

``parse_request`` turns them into an ``LMRequest`` once, at submit: the walks and the node read that.

Seeded sampling draws with the token's step index (0 for the prefill's token, i + 1 for decode
iteration i), so it does not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.graph import FinishReason, WalkGraph
from mstar.layers.grammar import GrammarMatchers
from mstar.layers.llama import check_llama_architecture
from mstar.layers.sampling import request_sampling
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.model.checkpoint import CheckpointError, check_load_format, reject_checkpoint
from mstar.model.decode import exact_length_params, prefill_finish
from mstar.model.tokenizer import LazyTokenizer
from mstar.models.llama import graph as llama_graph
from mstar.models.llama.config import TINY, LlamaConfig
from mstar.models.llama.loader import LOAD_FORMATS, build_llama_model, resolve_dtype
from mstar.models.llama.nodes import DEFAULT_SAMPLING
from mstar.models.llama.request import LMRequest
from mstar.models.llama.tokenizer import ByteTokenizer, checkpoint_eos_ids, load_tokenizer

__all__ = ["LlamaLM", "LlamaTiny"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class LlamaLM(LazyTokenizer, ModelDef):
    """A Hugging Face Llama checkpoint (``LlamaForCausalLM``) served as prefill + decode walks.

    ``model_path``: checkpoint directory (config.json, safetensors, tokenizer.json);
    ``load_format``: "auto"/"safetensors" (read the checkpoint) or "dummy" (seeded random weights;
    the config still comes from ``model_path`` or ``config``); ``dtype``: float32 / bfloat16 /
    float16; ``config``: a ``LlamaConfig`` or an HF config dict, instead of model_path/config.json;
    ``prepack``: prepack the projections at build time (``mstar.layers.prepack``; default ``None``:
    yes, with the compiled panel kernel where it builds, unless ``MSTAR_PREPACK=0``);
    ``weights_as_stored``: a GGUF file's Q8_0 / Q4_0 / Q4_1 projections, embedding and head kept
    quantized and multiplied as stored (``mstar.layers.quant``), instead of dequantized to ``dtype``.
    """

    checks_params = True  # parse_request looks up every params key (Runtime.submit refuses others)
    request_type = LMRequest

    name = "llama"
    default_sampling: Mapping[str, Any] = DEFAULT_SAMPLING

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto",
                 dtype: str | torch.dtype = "float32", config: LlamaConfig | Mapping[str, Any] | None = None,
                 seed: int = 0, prepack: bool | None = None, weights_as_stored: bool = False) -> None:
        self.prepack = prepack
        self.weights_as_stored = weights_as_stored
        self.model_path = str(model_path) if model_path is not None else None
        self.load_format = check_load_format(load_format, LOAD_FORMATS)
        self.dtype = resolve_dtype(dtype)
        self.seed = seed
        if config is None:
            if self.model_path is None:
                raise ValueError(f"{self.name}: model_path (a checkpoint directory with config.json) is "
                                 f"required, or pass config= (with load_format='dummy' for random weights)")
            config = LlamaConfig.from_pretrained(self.model_path)
        elif isinstance(config, Mapping):
            config = LlamaConfig.from_hf_dict(config, source="config")
        elif not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig or an HF config dict, got {type(config).__name__}")
        check_llama_architecture(config)
        self.config: LlamaConfig = config
        if load_format != "dummy" and self.model_path is None:
            raise CheckpointError(f"{self.name}: model_path is required to load weights (load_format="
                                  f"{load_format!r}); use load_format='dummy' for random weights")
        eos = checkpoint_eos_ids(self.model_path) if self.model_path is not None else ()
        self.eos_token_ids: tuple[int, ...] = eos or config.eos_token_ids

    def _load_tokenizer(self) -> Any:
        """The checkpoint's tokenizer.json (``ByteTokenizer`` without a checkpoint)."""
        if self.model_path is not None:
            return load_tokenizer(self.model_path, self.eos_token_ids)
        if self.config.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"{self.name}: no model_path to read a tokenizer from, and the vocabulary "
                             f"({self.config.vocab_size}) is too small for the byte tokenizer")
        return ByteTokenizer()

    # -- graph -----------------------------------------------------------------------------------
    def build_graph(self) -> WalkGraph:
        return llama_graph.build_graph(self.config.max_position_embeddings)

    def next_walk(self, state: WalkState) -> str | None:
        return llama_graph.next_walk(state)

    def finish_reason(self, state: WalkState) -> FinishReason | None:
        return prefill_finish(state) if state.last_walk == "prefill" else state.finish

    def sized_request(self, prompt_tokens: int, output_tokens: int, params: Mapping[str, Any],
                      seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Random prompt ids (never a special token: ids from 1 below the vocabulary's top 8) and
        exactly ``output_tokens`` tokens (EOS ignored)."""
        ids = torch.randint(1, max(2, self.config.vocab_size - 8), (prompt_tokens,),
                            generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids}, exact_length_params(params, output_tokens)

    def parse_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> LMRequest:
        vocab, max_pos = self.config.vocab_size, self.config.max_position_embeddings
        if "input_ids" not in inputs:
            raise ValueError(f"{self.name}: 'input_ids' is required (a 1-D integer tensor of token ids); "
                             f"got inputs {sorted(inputs)}")
        values = inputs["input_ids"]
        if len(values) != 1 or not isinstance(values[0], torch.Tensor):
            raise ValueError(f"{self.name}: input_ids must be one 1-D integer torch tensor of token ids")
        ids = values[0]
        if ids.dim() != 1 or ids.dtype not in _INT_DTYPES:
            raise ValueError(f"{self.name}: input_ids must be a 1-D integer tensor, got shape "
                             f"{tuple(ids.shape)} dtype {ids.dtype}")
        if ids.numel() == 0:
            raise ValueError(f"{self.name}: input_ids is empty")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{self.name}: input_ids must be token ids in [0, {vocab}), "
                             f"got {lo if lo < 0 else hi}")
        sp = request_sampling(params, self.default_sampling, extended=True)  # bad values raise ValueError
        bad_stop = [t for t in sp.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"{self.name}: stop_token_ids {bad_stop} are outside the vocabulary "
                             f"[0, {vocab})")
        if sp.grammar is not None:
            self.grammars.check(sp.grammar)
        bad_bias = [t for t, _ in sp.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"{self.name}: logit_bias token ids {bad_bias[:8]} are outside the vocabulary "
                             f"[0, {vocab})")
        n = ids.numel()
        if n + sp.max_tokens > max_pos:
            raise ValueError(f"{self.name}: prompt ({n} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{n + sp.max_tokens} exceeds max_position_embeddings ({max_pos})")
        return LMRequest.of(sp, self.eos_token_ids)

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], request: LMRequest) -> Mapping[str, int]:
        """The prompt and every generated token (the decode loop's speculative step included)."""
        return {llama_graph.NODE: inputs["input_ids"][0].numel() + request.sampling.max_tokens}

    def api_adapter(self):
        from mstar.models.llama.adapter import LlamaChatAdapter

        return LlamaChatAdapter(self)

    # -- modules ---------------------------------------------------------------------------------
    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        names = list(node_names)
        unknown = [n for n in names if n != llama_graph.NODE]
        if unknown:
            raise ValueError(f"{self.name} has only the {llama_graph.NODE!r} node, not {unknown}")
        if not names:
            return {}
        module = build_llama_model(self.config, model_path=self.model_path, load_format=self.load_format,
                                   dtype=self.dtype, eos_token_ids=self.eos_token_ids, seed=self.seed,
                                   prepack=self.prepack, weights_as_stored=self.weights_as_stored)
        module.grammars = self.grammars
        return {llama_graph.NODE: module}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_grammars", None)  # compiled per process (it holds the tokenizer's vocabulary)
        return state

    @property
    def grammars(self) -> GrammarMatchers:
        """Constrained decoding over this model's tokenizer (built on first use, in each process)."""
        engine = self.__dict__.get("_grammars")
        if engine is None:
            engine = self.__dict__["_grammars"] = GrammarMatchers(lambda: self.tokenizer, self.config.vocab_size)
        return engine


class LlamaTiny(LlamaLM):
    """The ``TINY`` Llama with seeded dummy weights and the byte tokenizer: runs offline, no files."""

    name = "llama-tiny"
    family = "llama"  # placement files written for llama fit the tiny twin

    def __init__(self, model_path: str | Path | None = None, load_format: str = "dummy",
                 dtype: str | torch.dtype = "float32", seed: int = 0, prepack: bool | None = None) -> None:
        reject_checkpoint(self.name, LlamaLM.name, model_path, load_format)
        super().__init__(None, "dummy", dtype, config=TINY, seed=seed, prepack=prepack)

    def _load_tokenizer(self) -> Any:
        return ByteTokenizer()
