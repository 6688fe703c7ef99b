"""Orpheus TTS: a Llama speech LM whose audio tokens stream, through a sliding window, into SNAC.

``OrpheusTTS`` serves the walks of ``graph.py`` with the nodes of ``nodes.py``; ``OrpheusTiny`` is its
offline twin; ``OrpheusGraph`` the graph and state machine alone. Prompt format, stop token and
sampling defaults: ``config.py``.

Checkpoint layout for ``orpheus``: ``--model-path DIR`` with the HF Llama checkpoint
(config.json, safetensors, tokenizer.json) and SNAC in ``DIR/snac`` (config.json +
pytorch_model.bin, the hub layout of hubertsiuzdak/snac_24khz), or ``snac_path=``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.graph import FinishReason, WalkGraph
from mstar.layers.llama import check_llama_architecture
from mstar.layers.prepack import prepack_linears, prepack_requested
from mstar.layers.sampling import request_sampling
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.model.checkpoint import check_load_format, reject_checkpoint
from mstar.model.decode import exact_length_params, prefill_finish
from mstar.model.tokenizer import LazyTokenizer
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.loader import LOAD_FORMATS, build_llama_model, resolve_dtype
from mstar.models.llama.request import LMRequest
from mstar.models.llama.tokenizer import ByteTokenizer, load_tokenizer
from mstar.models.orpheus import graph as orpheus_graph
from mstar.models.orpheus.config import (
    DEFAULT_SAMPLING,
    END_OF_PROMPT,
    MAX_NEW_TOKENS,
    START_OF_HUMAN,
    STOP_TOKEN,
    TINY_LLM,
)
from mstar.models.orpheus.loader import dummy_snac, load_snac
from mstar.models.orpheus.nodes import OrpheusLM, SnacDecoderNode

__all__ = ["OrpheusGraph", "OrpheusTTS", "OrpheusTiny"]


class OrpheusGraph(ModelDef):
    """Orpheus's graph and state machine alone (no weights): `mstar graph mstar.models.orpheus.model:OrpheusGraph`."""

    name = "orpheus-graph"

    def build_graph(self) -> WalkGraph:
        return orpheus_graph.build_graph()

    def next_walk(self, state: WalkState) -> str | None:
        return orpheus_graph.next_walk(state)


class OrpheusTTS(LazyTokenizer, ModelDef):
    checks_params = True  # parse_request looks up every params key (Runtime.submit refuses others)
    request_type = LMRequest
    name = "orpheus"
    constrain_audio = False
    candidate_logits = True  # with constrain_audio: see OrpheusLM

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto", dtype: str = "float32",
                 snac_path: str | Path | None = None, llm_config: LlamaConfig | None = None, seed: int = 0) -> None:
        check_load_format(load_format, LOAD_FORMATS)
        self.model_path = str(model_path) if model_path else None
        self.load_format, self.dtype, self.seed = load_format, resolve_dtype(dtype), seed
        if llm_config is None:
            if self.model_path is None:
                raise ValueError("orpheus needs --model-path (a checkpoint directory); or serve orpheus-tiny")
            llm_config = LlamaConfig.from_pretrained(self.model_path)
        check_llama_architecture(llm_config)
        if llm_config.vocab_size <= STOP_TOKEN:
            raise ValueError(f"an Orpheus LLM needs the audio-token vocabulary (> {STOP_TOKEN} ids), "
                             f"this one has {llm_config.vocab_size}")
        self.llm_config = llm_config
        if snac_path is None and self.model_path is not None:
            snac_path = Path(self.model_path) / "snac"
        self.snac_path = str(snac_path) if snac_path else None
        if load_format != "dummy" and not (self.snac_path and Path(self.snac_path).is_dir()):
            raise ValueError(f"orpheus: SNAC codec directory {self.snac_path!r} not found: put the SNAC 24 kHz "
                             f"checkpoint (config.json + pytorch_model.bin) in MODEL_PATH/snac or pass snac_path")

    def _load_tokenizer(self) -> Any:
        return load_tokenizer(self.model_path, (STOP_TOKEN,)) if self.model_path else ByteTokenizer()

    def prompt_ids(self, text: str, voice: str | None) -> list[int]:
        body = f"{voice}: {text}" if voice else text
        return [START_OF_HUMAN, *self.tokenizer.encode(body), *END_OF_PROMPT]

    def sized_request(self, prompt_tokens: int, output_tokens: int, params: Mapping[str, Any],
                      seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """A prompt of ``prompt_tokens`` ids (the human / end-of-prompt markers around random text
        bytes) and exactly ``output_tokens`` tokens (the stop token ignored)."""
        body = max(0, prompt_tokens - 1 - len(END_OF_PROMPT))
        text = torch.randint(ord("a"), ord("z") + 1, (body,), generator=torch.Generator().manual_seed(seed))
        ids = [START_OF_HUMAN, *self.tokenizer.encode(bytes(text.tolist()).decode())[:body], *END_OF_PROMPT]
        return {"input_ids": torch.tensor(ids, dtype=torch.long)}, exact_length_params(params, output_tokens)

    # -- graph -----------------------------------------------------------------------------------
    def build_graph(self) -> WalkGraph:
        return orpheus_graph.build_graph(min(MAX_NEW_TOKENS, self.llm_config.max_position_embeddings))

    def next_walk(self, state: WalkState) -> str | None:
        return orpheus_graph.next_walk(state)

    def finish_reason(self, state: WalkState) -> FinishReason | None:
        if state.partition == "llm" and state.last_walk == "prefill":
            return prefill_finish(state)
        return state.finish

    def parse_request(self, inputs, params) -> LMRequest:
        """The speech LM's sampling (no OpenAI penalties, bias or logprobs: the constrained sampler maps
        token ids), parsed once."""
        if "input_ids" not in inputs or len(inputs["input_ids"]) != 1:
            raise ValueError("orpheus: 'input_ids' (one 1-D tensor of prompt token ids) is required")
        ids = inputs["input_ids"][0]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError("orpheus: input_ids must be a non-empty 1-D integer tensor")
        if int(ids.min()) < 0 or int(ids.max()) >= self.llm_config.vocab_size:
            raise ValueError(f"orpheus: input_ids must be in [0, {self.llm_config.vocab_size})")
        sp = request_sampling(params, DEFAULT_SAMPLING)
        if ids.numel() + sp.max_tokens > self.llm_config.max_position_embeddings:
            raise ValueError(f"orpheus: prompt ({ids.numel()} tokens) + max_tokens ({sp.max_tokens}) exceeds the "
                             f"context of {self.llm_config.max_position_embeddings} tokens")
        return LMRequest.of(sp, (STOP_TOKEN,))

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], request: LMRequest) -> Mapping[str, int]:
        """The speech LM's prompt and every generated token (SNAC holds no KV cache)."""
        return {"LLM": inputs["input_ids"][0].numel() + request.sampling.max_tokens}

    # -- modules ---------------------------------------------------------------------------------
    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        mods: dict[str, NodeSubmodule] = {}
        for node in node_names:
            if node == "LLM":
                llm = build_llama_model(self.llm_config, model_path=self.model_path, load_format=self.load_format,
                                        dtype=self.dtype, eos_token_ids=(STOP_TOKEN,), seed=self.seed,
                                        module_cls=OrpheusLM, prepack=False)
                llm.constrain_audio, llm.candidate_logits = self.constrain_audio, self.candidate_logits
                if prepack_requested():  # after the switches: they decide whether the head is prepacked
                    prepack_linears(llm)
                mods[node] = llm
            elif node == "snac_decoder":
                codec = (dummy_snac(self.seed) if self.load_format == "dummy" and not self.snac_path
                         else load_snac(self.snac_path, noise=False))
                mods[node] = SnacDecoderNode(codec.eval())
            else:
                raise ValueError(f"orpheus has no node {node!r}")
        return mods

    def api_adapter(self):
        from mstar.models.orpheus.adapter import OrpheusAdapter

        return OrpheusAdapter(self)


class OrpheusTiny(OrpheusTTS):
    """Tiny Llama (real Orpheus vocabulary) + tiny SNAC, dummy weights, byte tokenizer: offline, fast."""

    name = "orpheus-tiny"
    family = "orpheus"  # placement files written for orpheus fit the tiny twin
    constrain_audio = True

    def __init__(self, model_path: str | None = None, load_format: str = "dummy", hidden_size: int = 64,
                 num_layers: int = 2, head_dim: int = 16, seed: int = 0, candidate_logits: bool = True) -> None:
        reject_checkpoint(self.name, OrpheusTTS.name, model_path, load_format)
        heads = max(1, hidden_size // head_dim)
        cfg = LlamaConfig.from_hf_dict({**TINY_LLM.to_hf_dict(), "hidden_size": hidden_size,
                                        "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
                                        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
                                        "head_dim": head_dim}, source="orpheus-tiny")
        super().__init__(None, "dummy", "float32", None, cfg, seed)
        self.candidate_logits = candidate_logits
