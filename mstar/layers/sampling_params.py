"""``SamplingParams``: a request's sampling settings, checked once (``request_sampling`` builds them
from a request's params); what :mod:`mstar.layers.sampling` applies to a batch's logits."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch

from mstar.layers.grammar import GrammarSpec
from mstar.model.sendable import register_message

__all__ = ["EXTENDED_FIELDS", "MAX_LOGPROBS", "SamplingParams", "is_int", "request_sampling"]

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's: a bias is in [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's bound on how many tokens one request biases
# The fields beyond HF's set: a model whose nodes do not read them refuses them (``request_sampling``)
EXTENDED_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "grammar")


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@register_message  # it travels inside a family's typed request (mstar.model.request)
@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling configuration.

    * ``temperature``: ``0`` selects greedy decoding (argmax); otherwise logits are divided by it.
    * ``top_k``: keep only the ``top_k`` highest logits (ties with the k-th value are kept); ``0`` disables.
    * ``top_p``: keep the smallest set of most likely tokens whose probability mass reaches ``top_p``;
      ``1.0`` disables.
    * ``repetition_penalty``: HF semantics; for every token already seen (prompt + generated) a positive
      logit is divided by the penalty and a non-positive one multiplied by it. ``1.0`` disables.
    * ``presence_penalty`` / ``frequency_penalty``: OpenAI semantics, in [-2, 2]; for every token
      generated so far (not the prompt's), its logit is lowered by the presence penalty once and by the
      frequency penalty times its count. ``0`` disables.
    * ``logit_bias``: ``(token id, bias)`` pairs (a mapping is accepted), each bias in [-100, 100],
      added to that token's logit before anything else. The ids are checked against the vocabulary
      by the model (``validate_request``).
    * ``logprobs``: ``None`` (off), or how many most likely alternatives (0-20) to report beside the
      sampled token's log probability (``sample_with_logprobs``).
    * ``grammar``: a ``GrammarSpec`` (or ``{"type", "value"}``) the output must match: the model's node
      masks each step's logits to it (``mstar.layers.grammar``) before they reach ``sample``.
    * ``seed``: makes sampling reproducible and batch invariant; ``None`` uses a process-wide generator.
    * ``max_tokens``, ``stop_token_ids``, ``ignore_eos``: stopping criteria, carried for the scheduler.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # temperature
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        # top_k
        if not is_int(self.top_k):
            raise ValueError(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k!r}")
        # top_p
        if not _is_real(self.top_p) or not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", float(self.top_p))
        # repetition_penalty
        if not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        # seed
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        # max_tokens
        if not is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        # stop_token_ids
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence):
            raise ValueError(f"stop_token_ids must be a sequence of ints >= 0, got {stop!r}")
        if not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must contain only ints >= 0, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        # ignore_eos
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._check_extended()

    def _check_extended(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
            object.__setattr__(self, name, float(v))
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not all(
                isinstance(p, Sequence) and len(p) == 2 for p in pairs):
            raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
        if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}")
        clean = {}
        for tok, b in pairs:
            tok = int(tok) if isinstance(tok, str) and tok.strip().isdigit() else tok
            if not is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not _is_real(b) or not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tok}")
            clean[tok] = float(b)
        object.__setattr__(self, "logit_bias", tuple(sorted(clean.items())))
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.grammar is not None:
            object.__setattr__(self, "grammar", GrammarSpec.parse(self.grammar))

    @property
    def needs_seen(self) -> bool:
        """Whether sampling reads the tokens seen so far (a penalty, or a grammar's generated tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.grammar is not None)

    @property
    def extended(self) -> tuple[str, ...]:
        """The ``EXTENDED_FIELDS`` this request sets (a model that does not read them refuses it)."""
        used = (self.presence_penalty != 0.0, self.frequency_penalty != 0.0, bool(self.logit_bias),
                self.logprobs is not None, self.grammar is not None)
        return tuple(name for name, on in zip(EXTENDED_FIELDS, used) if on)

    @cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as ``(ids int64, biases float32)`` (built once per request)."""
        return (torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long),
                torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32))

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SamplingParams:
        """Build from a mapping (e.g. a request's JSON body).

        Keys whose value is ``None`` are ignored (the default is used).  Unknown keys raise ``ValueError``
        listing the valid keys.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be a mapping, got {type(d).__name__}")
        valid = cls.field_names()
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; valid keys are: {', '.join(valid)}")
        kwargs = {k: v for k, v in d.items() if v is not None}
        return cls(**kwargs)  # type: ignore[arg-type]


def request_sampling(params: Mapping[str, Any],
                     defaults: Mapping[str, Any], *, extended: bool = False) -> SamplingParams:
    """The request's ``SamplingParams``: ``defaults``, then ``params["sampling"]``, then a top-level
    ``params["max_tokens"]``. Bad values raise ValueError; so does a field of ``EXTENDED_FIELDS``
    unless ``extended`` (the caller's nodes apply them), rather than being ignored."""
    sampling = params.get("sampling") or {}
    if not isinstance(sampling, Mapping):
        raise ValueError(f"params['sampling'] must be a mapping, got {type(sampling).__name__}")
    merged = {**defaults, **{k: v for k, v in sampling.items() if v is not None}}
    if params.get("max_tokens") is not None:
        merged["max_tokens"] = params["max_tokens"]
    sp = SamplingParams.from_dict(merged)
    if not extended and sp.extended:
        raise ValueError(f"{', '.join(sp.extended)}: not supported by this model")
    return sp
