"""Constrained decoding: a request's ``GrammarSpec`` (a JSON schema, any JSON object, a regex or a
Lark grammar) becomes a token mask per decode step, through llguidance (a Rust grammar engine from
PyPI with no dependencies; compiling a JSON schema takes about a millisecond and a mask tens of
microseconds, and masks are computed per row, so constrained and free requests share one batched
step).

``GrammarMatchers`` (one per model node, over the model's tokenizer):

* ``check(spec)``: ValueError naming the problem for a schema or grammar llguidance refuses;
* ``mask_rows(logits, rows)``: every constrained row's logits outside its grammar set to ``-inf``.

A row's matcher state is derived from the request's own tokens, not kept as the truth: the engine
keeps, per request, a matcher and the generated tokens it consumed; at each step the row brings its
generated tokens (the tail of the walk's ``seen`` tokens), and the matcher consumes the new ones, or
is rebuilt from the compiled grammar when they do not extend what it consumed (a preempted and
recomputed request, a decode placed on another rank). ``release`` drops a request's matcher.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.model.sendable import register_message

__all__ = ["GRAMMAR_KINDS", "GrammarMatchers", "GrammarRow", "GrammarSpec"]

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_GRAMMAR_CHARS = 1 << 20  # a schema or grammar's text; compiling is linear in it
_BYTE_SHIFTS = torch.arange(8, dtype=torch.uint8)


@register_message  # inside a request's SamplingParams
@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` one of ``GRAMMAR_KINDS`` and ``source`` its text
    (a JSON schema as JSON text, a regex, a Lark grammar; empty for ``json_object``)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar type must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"grammar {self.kind} must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"grammar {self.kind} is empty")

    @classmethod
    def parse(cls, value: Any) -> GrammarSpec:
        """A spec from a request's params: a ``GrammarSpec``, or ``{"type": kind, "value": source}``
        (a JSON schema may be given as an object)."""
        if isinstance(value, GrammarSpec):
            return value
        if not isinstance(value, Mapping) or set(value) - {"type", "value"} or "type" not in value:
            raise ValueError('grammar must be {"type": "json_schema" | "json_object" | "regex" | "lark", '
                             '"value": ...}')
        source = value.get("value", "")
        if value["type"] == "json_schema" and isinstance(source, Mapping):
            source = json.dumps(source, sort_keys=True)
        return cls(value["type"], "" if source is None else source)

    def to_params(self) -> dict[str, str]:
        return {"type": self.kind, "value": self.source}

    def grammar(self) -> str:
        """The llguidance grammar text."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(schema)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)


@dataclass(frozen=True)
class GrammarRow:
    """One constrained row of a batch: its index, request, spec and the tokens it generated so far."""

    row: int
    request_id: str
    spec: GrammarSpec
    generated: Sequence[int]


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer for one of ours: a ``tokenizers`` JSON (``to_json``), or the bytes of
    every token (``token_bytes``, specials listed in ``special_token_ids``)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = [int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ()]
    if hasattr(tokenizer, "to_json"):
        return LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)
    if hasattr(tokenizer, "token_bytes"):
        return LLTokenizer(TokenizerWrapper(_BytesVocabulary(tokenizer)), n_vocab=vocab_size, eos_token=eos or None)
    raise ValueError(f"constrained decoding needs a tokenizers JSON or the token bytes; {tokenizer!r} has neither")


class _BytesVocabulary:
    """The attributes llguidance's ``TokenizerWrapper`` reads, over a tokenizer with ``token_bytes``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = list(getattr(tokenizer, "special_token_ids", ()))

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tok.encode(s, add_special_tokens=False)


class GrammarMatchers:
    """Compiled grammars (by spec) and the matchers of the requests under way, over one tokenizer
    (built on first use by ``make_tokenizer``: it loads a vocabulary)."""

    def __init__(self, make_tokenizer: Callable[[], Any], vocab_size: int, max_compiled: int = 256,
                 max_requests: int = 4096) -> None:
        self._make_tokenizer, self.vocab_size = make_tokenizer, vocab_size
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._max_compiled, self._max_requests = max_compiled, max_requests
        self._matchers: OrderedDict[str, tuple[Any, list[int]]] = OrderedDict()  # rid -> (matcher, consumed)

    def _tok(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = ll_tokenizer(self._make_tokenizer(), self.vocab_size)
        return self._tokenizer

    def compiled(self, spec: GrammarSpec) -> Any:
        """The spec's matcher at its start (compiled once, then kept; copy it to use it)."""
        from llguidance import LLMatcher

        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        matcher = LLMatcher(self._tok(), spec.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {matcher.get_error()}")
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > self._max_compiled:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, spec: GrammarSpec) -> None:
        """ValueError naming the problem when the spec does not compile."""
        self.compiled(spec)

    def _matcher(self, r: GrammarRow) -> Any:
        generated = [int(t) for t in r.generated]
        held = self._matchers.get(r.request_id)
        if held is not None and generated[:len(held[1])] == held[1]:
            matcher, consumed = held
            self._matchers.move_to_end(r.request_id)
        else:  # first step, or tokens that do not extend what it saw: start again from the grammar
            matcher, consumed = self.compiled(r.spec).deep_copy(), []
        new = generated[len(consumed):]
        if new and matcher.try_consume_tokens(new) < len(new) and not matcher.is_stopped():
            # a finished grammar takes nothing more: a step run past the request's end (a loop whose
            # stop is checked one step late) brings its EOS, and is dropped; anything else is a bug
            raise ValueError(f"request {r.request_id}: generated tokens the grammar does not allow "
                             f"({matcher.get_error()})")
        self._matchers[r.request_id] = (matcher, generated)
        while len(self._matchers) > self._max_requests:
            self._matchers.popitem(last=False)
        return matcher

    def mask_rows(self, logits: torch.Tensor, rows: Sequence[GrammarRow]) -> torch.Tensor:
        """``logits`` [B, V] as float32 with each of ``rows``' disallowed tokens at ``-inf`` (a new
        tensor; the other rows unchanged)."""
        out = logits.to(torch.float32, copy=True)
        if not rows:
            return out
        words = (self.vocab_size + 31) // 32
        bits = torch.empty((len(rows), words), dtype=torch.int32)
        for k, r in enumerate(rows):
            v = bits[k]
            self._matcher(r).unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        # bit j of 32-bit word w allows token 32 w + j; read as bytes (little-endian), bit k of byte b
        # is token 8 b + k: unpacked bytewise, a quarter of the memory of unpacking the words
        if sys.byteorder == "little":
            unpacked = (bits.view(torch.uint8).unsqueeze(-1) >> _BYTE_SHIFTS) & 1
        else:
            unpacked = (bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        blocked = unpacked.view(len(rows), -1)[:, :out.shape[1]] == 0
        if len(rows) == out.shape[0] and all(r.row == k for k, r in enumerate(rows)):
            return out.masked_fill_(blocked.to(out.device), float("-inf"))
        idx = torch.tensor([r.row for r in rows], dtype=torch.long)
        out[idx] = out[idx].masked_fill(blocked.to(out.device), float("-inf"))
        return out

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
