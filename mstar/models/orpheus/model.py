"""Orpheus TTS: a Llama speech LM whose audio tokens stream, through a sliding window, into SNAC.

Prompt (as the reference): ``[128259] + tokenize(f"{voice}: {text}") + [128009, 128260, 128261,
128257]``; generation stops at token 128258 or after ``max_tokens``. Sampling defaults:
temperature 0.6, top_p 0.8, repetition_penalty 1.3, 1200 new tokens. Emotion tags such as
``<laugh>`` are plain text in the prompt.

Checkpoint layout for ``orpheus``: ``--model-path DIR`` with the HF Llama checkpoint
(config.json, safetensors, tokenizer.json) and SNAC in ``DIR/snac`` (config.json +
pytorch_model.bin, the hub layout of hubertsiuzdak/snac_24khz), or ``snac_path=``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.layers.llama import check_llama_architecture
from mstar.layers.rotary import RopeScaling
from mstar.layers.sampling import sample
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.loader import LOAD_FORMATS, build_llama_model, resolve_dtype
from mstar.models.llama.modules import LlamaCausalLM, request_sampling, stop_token_set
from mstar.models.llama.tokenizer import ByteTokenizer, load_tokenizer
from mstar.models.orpheus.codec import AUDIO_TOKEN_BASE, CODE_SIZE, TOKENS_PER_FRAME, SnacDecoderNode
from mstar.models.orpheus.graph import build_orpheus_graph, orpheus_next_walk
from mstar.models.orpheus.snac_loader import dummy_snac, load_snac

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


class OrpheusLM(LlamaCausalLM):
    """The Llama node, plus ``audio_token``: the sampled token when it is an audio token, else nothing.

    ``constrain_audio``: sample only the stop token or the audio tokens valid at the next position
    (the i-th generated token can only carry a code of SNAC position i % 7). Off for real
    checkpoints (the reference does not constrain); on for orpheus-tiny, whose random weights would
    otherwise produce invalid codes and hence silence.
    """

    constrain_audio = False

    def sample_next(self, last, engine_inputs):
        if not self.constrain_audio:
            return super().sample_next(last, engine_inputs)
        # Only the stop token and the 4096 audio tokens of the next position can be sampled: compute
        # just those logits (in vocabulary order, so the seeded draw equals a full-vocabulary
        # sample with every other logit masked), sample among them, map back to token ids.
        ei = engine_inputs
        weight = self.lm_head.weight
        cols, rows = [], []
        for r, step in enumerate(ei.extras["step"]):
            lo = AUDIO_TOKEN_BASE + (step % TOKENS_PER_FRAME) * CODE_SIZE
            cols.append(torch.cat([torch.tensor([STOP_TOKEN]), torch.arange(lo, lo + CODE_SIZE)]))
            # the window is a contiguous slice of the head: no gather, one small matmul
            rows.append(torch.cat([last[r:r + 1] @ weight[STOP_TOKEN:STOP_TOKEN + 1].T,
                                   last[r:r + 1] @ weight[lo:lo + CODE_SIZE].T], dim=1))
        logits = torch.cat(rows)
        seen = self.seen_lists(ei)
        if seen is not None:  # the penalty counts only tokens that are candidates here: map them
            seen = [[0 if t == STOP_TOKEN else 1 + t - int(c[1]) for t in s
                     if t == STOP_TOKEN or int(c[1]) <= t < int(c[1]) + CODE_SIZE] for c, s in zip(cols, seen)]
        picked = sample(logits, ei.extras["sampling"], seen, ei.extras["step"]).cpu()
        return torch.stack([c[i] for c, i in zip(cols, picked)])

    def forward(self, graph_walk, engine_inputs, ids):
        out = super().forward(graph_walk, engine_inputs, ids)
        out["audio_token"] = [[t] if int(t) >= AUDIO_TOKEN_BASE else [] for t in out["token"]]
        return out


class OrpheusTTS(ModelDef):
    name = "orpheus"
    constrain_audio = False

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto", dtype: str = "float32",
                 snac_path: str | Path | None = None, llm_config: LlamaConfig | None = None, seed: int = 0) -> None:
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
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
        self._tokenizer = None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_tokenizer"] = None
        return state

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path, (STOP_TOKEN,)) if self.model_path else ByteTokenizer()
        return self._tokenizer

    def prompt_ids(self, text: str, voice: str | None) -> list[int]:
        body = f"{voice}: {text}" if voice else text
        return [START_OF_HUMAN, *self.tokenizer.encode(body), *END_OF_PROMPT]

    # -- graph -----------------------------------------------------------------------------------
    def build_graph(self):
        return build_orpheus_graph(min(MAX_NEW_TOKENS, self.llm_config.max_position_embeddings))

    def sampling_params(self, params: Mapping[str, Any]):
        return request_sampling(params, DEFAULT_SAMPLING)

    def next_walk(self, state: WalkState) -> str | None:
        first_ends = False
        if state.partition == "llm" and state.last_walk == "prefill":
            sp = self.sampling_params(state.params)
            token = int(state.tensors["token"][0].reshape(-1)[0])
            first_ends = sp.max_tokens <= 1 or token in stop_token_set(sp, (STOP_TOKEN,))
        return orpheus_next_walk(state, first_ends)

    def validate_request(self, inputs, params) -> None:
        if "input_ids" not in inputs or len(inputs["input_ids"]) != 1:
            raise ValueError("orpheus: 'input_ids' (one 1-D tensor of prompt token ids) is required")
        ids = inputs["input_ids"][0]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError("orpheus: input_ids must be a non-empty 1-D integer tensor")
        if int(ids.min()) < 0 or int(ids.max()) >= self.llm_config.vocab_size:
            raise ValueError(f"orpheus: input_ids must be in [0, {self.llm_config.vocab_size})")
        sp = self.sampling_params(params)
        if ids.numel() + sp.max_tokens > self.llm_config.max_position_embeddings:
            raise ValueError(f"orpheus: prompt ({ids.numel()} tokens) + max_tokens ({sp.max_tokens}) exceeds the "
                             f"context of {self.llm_config.max_position_embeddings} tokens")

    # -- modules ---------------------------------------------------------------------------------
    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        mods: dict[str, NodeSubmodule] = {}
        for node in node_names:
            if node == "LLM":
                mods[node] = build_llama_model(self.llm_config, model_path=self.model_path,
                                               load_format=self.load_format, dtype=self.dtype,
                                               eos_token_ids=(STOP_TOKEN,), seed=self.seed,
                                               default_sampling=DEFAULT_SAMPLING, module_cls=OrpheusLM)
                mods[node].constrain_audio = self.constrain_audio
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
    constrain_audio = True

    def __init__(self, model_path: str | None = None, load_format: str = "dummy", hidden_size: int = 64,
                 num_layers: int = 2, head_dim: int = 16, seed: int = 0) -> None:
        if model_path is not None or load_format != "dummy":
            raise ValueError("orpheus-tiny always uses dummy weights; use 'orpheus' with --model-path")
        heads = max(1, hidden_size // head_dim)
        cfg = LlamaConfig.from_hf_dict({**TINY_LLM.to_hf_dict(), "hidden_size": hidden_size,
                                        "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
                                        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
                                        "head_dim": head_dim}, source="orpheus-tiny")
        super().__init__(None, "dummy", "float32", None, cfg, seed)
