"""The ``LLM`` node of a Llama: backbone + LM head + sampling, over the runtime's paged KV cache.

One module serves both walks and batches them together:

* ``prefill``: input ``input_ids`` (the prompt) -> the first generated token;
* ``decode``: input ``token`` (the previous token) -> the next one, plus the loop's ``stop`` flag.

Besides ``token`` and ``stop`` the node outputs ``seen``: the prompt and every generated token so
far (int64), which the repetition, presence and frequency penalties need. It travels through the
walk (request state after prefill, a loop feedback edge in decode), so it is correct wherever each
walk runs; requests without a penalty carry an empty tensor instead. ``logprobs`` is, for a request
that asks for them, ``[ids, logprobs]`` of the sampled token and its most likely alternatives
(``mstar.layers.sampling.RowLogprobs``), and an empty list (nothing emitted) for the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.attention_backends import AttentionBackend
from mstar.layers.grammar import GrammarMatchers, GrammarRow
from mstar.layers.llama import LlamaBackbone, pack_linears
from mstar.layers.prepack import PrepackedLinear, can_prepack
from mstar.layers.quant import QuantizedLinear
from mstar.layers.sampling import RowLogprobs, SamplingParams, sample, sample_with_logprobs
from mstar.model.decode import generation_finish_rows
from mstar.model.submodule import EngineInputs, ForwardInfo, KVSpec, NodeInputs, NodeSubmodule
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.request import LMRequest

__all__ = ["DEFAULT_SAMPLING", "LlamaCausalLM"]

# Defaults under a request's ``params["sampling"]``: greedy, 16 new tokens.
DEFAULT_SAMPLING: Mapping[str, Any] = {"temperature": 0.0, "max_tokens": 16}


@dataclass(slots=True)
class LMArgs:
    """One request's values for an LLM forward besides its token ids (``NodeInputs.args``)."""

    request: LMRequest  # its sampling and stop ids
    step: int  # the generated token this forward samples (0: the prefill's)
    seen: torch.Tensor | None  # the prompt and generated tokens, for the penalties (None: the request has none)


def sampling_of(ei: EngineInputs) -> list[SamplingParams]:
    """Each row's sampling parameters (``LMArgs``)."""
    return [a.request.sampling for a in ei.args]


def steps_of(ei: EngineInputs) -> list[int]:
    return [a.step for a in ei.args]


class LlamaCausalLM(NodeSubmodule):
    """``model`` (a ``LlamaBackbone``) + ``lm_head``: HF ``LlamaForCausalLM`` parameter names."""

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, eos_token_ids: Iterable[int] | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config, dtype=dtype, device=device, backend=backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                                 device=device)
        self.kv_spec = KVSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)
        self.eos_token_ids = tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.prepacked: PrepackedLinear | QuantizedLinear | None = None  # the LM head, prepacked or as stored
        self.stored_head = False  # ``prepacked`` is the head as stored (``use_stored_head``)
        self.grammars: GrammarMatchers | None = None  # constrained decoding (the model sets it)
        # the last ``step_outputs``' per-row tokens and the batch tensor they are rows of
        self._token_rows: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` the LM head is the embedding matrix (one parameter)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def pack_weights(self) -> None:
        """Re-lay out the projections and the LM head for fast CPU matrix multiplies (see
        ``mstar.layers.llama``); a tied head stays tied. Call before loading weights (or after: the
        values are kept)."""
        self.model.pack_weights()
        pack_linears(self.lm_head)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight

    def prepack(self) -> bool:
        """Prepack the LM head (``mstar.layers.prepack.prepack_linears`` prepacks the backbone's
        layers), unless a subclass computes its logits in its own way (it would not use it)."""
        own = type(self).compute_logits is LlamaCausalLM.compute_logits and \
            type(self).sample_next is LlamaCausalLM.sample_next
        return own and self.prepack_head()

    def use_stored_head(self, head: QuantizedLinear) -> None:
        """Compute logits with the quantized head as stored (its ``nn.Linear`` is then unused)."""
        self.prepacked, self.stored_head = head, True

    def prepack_head(self) -> bool:
        """Prepack the LM head for ``compute_logits`` (False if this build cannot)."""
        if self.stored_head:
            return False
        if not can_prepack(self.lm_head.weight):
            return False
        self.prepacked = PrepackedLinear(self.lm_head.weight)
        return True

    @property
    def vocab_parallel_head(self) -> bool:
        """Whether tensor parallelism may shard the LM head by vocabulary
        (``mstar.layers.tensor_parallel``): yes, logits only come from ``compute_logits``."""
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (model dtype) of final-normed hidden states ``[N, hidden]``."""
        pre = self.prepacked
        if self.stored_head or (pre is not None and pre.fresh(self.lm_head.weight)):
            return pre(hidden)
        return self.lm_head(hidden)

    def process_logits(self, logits: torch.Tensor, engine_inputs: EngineInputs) -> torch.Tensor:
        """Hook for subclasses (e.g. constrained decoding) before sampling; the identity here."""
        return logits

    # -- runtime interface -----------------------------------------------------------------------
    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        req: LMRequest = fwd_info.params  # parsed once, at submit (LlamaLM.parse_request)
        sp = req.sampling
        if "input_ids" in inputs:  # prefill: the prompt; first sampled token
            ids = inputs["input_ids"][0].reshape(-1).to(torch.long)
            step = 0
            seen = ids if sp.needs_seen else None
        else:  # decode: the previous token; iteration i samples token i + 1
            ids = inputs["token"][0]
            if ids.dim() != 1 or ids.dtype != torch.long:  # as step_outputs makes it: int64 [1]
                ids = ids.reshape(-1).to(torch.long)
            step = fwd_info.iteration[-1] + 1 if fwd_info.iteration else 0
            seen = inputs["seen"][0].reshape(-1).to(torch.long) if sp.needs_seen else None
        if ids.numel() == 0:
            raise ValueError("LLM node got no tokens")
        return NodeInputs(tensor_inputs={"ids": ids}, num_tokens=ids.numel(), args=LMArgs(req, step, seen),
                          prefix_ids=ids if step == 0 and "input_ids" in inputs else None, token_inputs=("ids",))

    def continue_batch(self, graph_walk: str | None, engine_inputs: EngineInputs, tensors: Mapping[str, torch.Tensor],
                       outputs: Mapping[str, list[Any]]) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]] | None:
        """A decode step's next batch: each row's new token as its ids, its step one further, its
        seen tokens (a repetition penalty's) the fed-back ``seen``; what ``prepare_inputs`` makes of
        the fed-back ``token`` and ``seen``. Not when a subclass prepares its inputs in its own way."""
        if type(self).prepare_inputs is not LlamaCausalLM.prepare_inputs:
            return None
        tokens = outputs.get("token")
        if tokens is None:
            return None
        made = self._token_rows
        if made is not None and made[0] is tokens:  # this module's rows, untouched: their batch tensor
            ids = made[1]
        else:
            ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0].reshape(-1)
        if ids.dtype != torch.long or ids.shape[0] != len(tokens):
            return None
        args: list[LMArgs] = engine_inputs.args
        if all(a.seen is None for a in args):
            nxt = [LMArgs(a.request, a.step + 1, None) for a in args]
        else:  # rows with a penalty count the new token too
            nxt = [LMArgs(a.request, a.step + 1, None if a.seen is None else s.reshape(-1))
                   for a, s in zip(args, outputs["seen"])]
        return {"ids": ids}, nxt

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs,
                ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        ei = engine_inputs
        hidden = self.model(ids, ei)
        # one token per request (a decode step): every row is a request's last
        last = hidden if hidden.shape[0] == ei.batch_size else hidden[ei.last_token_rows().to(hidden.device)]
        if any(a.request.sampling.logprobs is not None for a in ei.args):
            tokens, logprobs = self._sample(last, ei, with_logprobs=True)
            return self.step_outputs(tokens, ei, logprobs)
        return self.step_outputs(self.sample_next(last, ei), ei)

    @staticmethod
    def seen_lists(engine_inputs: EngineInputs) -> list[list[int]] | None:
        """Per request, the tokens the penalties count (None when no request uses one)."""
        seen = [a.seen for a in engine_inputs.args]
        return None if all(s is None for s in seen) else [[] if s is None else s.tolist() for s in seen]

    def sample_next(self, last: torch.Tensor, engine_inputs: EngineInputs) -> torch.Tensor:
        """The next token of every request (int64 [B], CPU) from its last hidden state."""
        return self._sample(last, engine_inputs, with_logprobs=False)[0]

    def _sample(self, last: torch.Tensor, ei: EngineInputs,
                with_logprobs: bool) -> tuple[torch.Tensor, list[RowLogprobs | None] | None]:
        logits = self.process_logits(self.compute_logits(last), ei)
        seen = [a.seen for a in ei.args]  # the rows' seen-token tensors as they are (None: no penalty)
        seen = None if seen.count(None) == len(seen) else seen
        sampling, steps = sampling_of(ei), steps_of(ei)
        logits = self._constrained(logits, ei, sampling, seen)
        if with_logprobs:
            tokens, logprobs = sample_with_logprobs(logits, sampling, seen, steps)
            return tokens.cpu(), logprobs
        return sample(logits, sampling, seen, steps).cpu(), None

    def _constrained(self, logits: torch.Tensor, ei: EngineInputs, sampling: list[SamplingParams],
                     seen: list | None) -> torch.Tensor:
        """The logits with each grammar row's disallowed tokens at -inf (``mstar.layers.grammar``); a
        row's generated tokens are the last ``step`` of its seen tokens."""
        rows = [i for i, sp in enumerate(sampling) if sp.grammar is not None]
        if not rows:
            return logits
        if self.grammars is None:
            raise ValueError("this LLM node has no grammar matchers: constrained decoding is not available")
        steps = steps_of(ei)
        grammar_rows = []
        for i in rows:
            ids = seen[i].reshape(-1) if seen is not None and seen[i] is not None else torch.zeros(0, dtype=torch.long)
            n = steps[i]
            grammar_rows.append(GrammarRow(i, ei.request_ids[i], sampling[i].grammar,
                                           ids[ids.numel() - n:].tolist() if n else []))
        return self.grammars.mask_rows(logits, grammar_rows)

    def release(self, request_id: str) -> None:
        if self.grammars is not None:
            self.grammars.release(request_id)

    def step_outputs(self, tokens: torch.Tensor, engine_inputs: EngineInputs,
                     logprobs: list[RowLogprobs | None] | None = None) -> dict[str, list[Any]]:
        """Per request: its new token (int64 [1], a view of one batch tensor), ``seen``, ``logprobs``
        (``[ids, logprobs]``, or an empty list: none asked for) and the loop's ``stop`` flag (the
        ``FinishReason`` of its last token, None while it goes on: the tracker reads it, and the
        prefill's goes to the request's state)."""
        args: list[LMArgs] = engine_inputs.args
        batch = tokens.clone()
        out_tokens = list(batch.view(-1, 1).unbind(0))
        self._token_rows = (out_tokens, batch)
        out_stop = generation_finish_rows(tokens.tolist(), [a.step for a in args],
                                          [a.request.sampling for a in args], [a.request.stop_ids for a in args])
        empty = torch.zeros(0, dtype=torch.long)  # carried by requests without a repetition penalty
        if all(a.seen is None for a in args):
            out_seen = [empty] * len(out_tokens)
        else:
            out_seen = [empty if a.seen is None else torch.cat([a.seen.cpu(), t]) for a, t in zip(args, out_tokens)]
        if logprobs is None:
            out_logprobs: list[Any] = [_NO_LOGPROBS] * len(out_tokens)
        else:
            out_logprobs = [_NO_LOGPROBS if r is None else [r.ids, r.logprobs] for r in logprobs]
        return {"token": out_tokens, "seen": out_seen, "logprobs": out_logprobs, "stop": out_stop}


_NO_LOGPROBS: list[Any] = []  # a row's ``logprobs`` when it asked for none: nothing is emitted
