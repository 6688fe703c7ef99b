"""The tokenizer and chat template a GGUF file carries in its metadata.

A GGUF has no ``tokenizer.json``: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``), the
BPE merges (``tokenizer.ggml.merges``), each token's type (``tokenizer.ggml.token_type``: 3 is a
control token such as ``<|im_end|>``, 4 a user-defined one) and the name of the pre-tokenizer
(``tokenizer.ggml.pre``) its converter recognised. ``build_gguf_tokenizer`` rebuilds a ``tokenizers``
byte-level BPE from them; the pre-tokenizer follows llama.cpp's for that name:

* ``smollm`` (SmolLM / SmolLM2), ``starcoder``, ``refact``: every digit on its own, then GPT-2's split
  (the ``Digits(individual_digits=True)`` + ``ByteLevel`` pair of SmolLM2's own ``tokenizer.json``);
* ``gpt-2``, ``mpt``, ``olmo``, ``jais``: GPT-2's split alone.

Control tokens are special (matched whole in the text, dropped by ``skip_special_tokens``),
user-defined ones are matched whole but kept when decoding. A BOS (EOS) is added by ``encode``
only when ``tokenizer.ggml.add_bos_token`` (``add_eos_token``) says so.

transformers' GGUF conversion knows no ``smollm`` split and so leaves the digits to GPT-2's regex;
the two agree except where whitespace runs meet digits (``"  12"``: ``ĠĠ 1 2`` here and in the
reference tokenizer, ``Ġ Ġ 1 2`` in transformers').
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from mstar.model.checkpoint import CheckpointError
from mstar.model.gguf_file import GGUFFile, open_gguf
from mstar.models.llama.config import gguf_eos_ids
from mstar.models.llama.hf_tokenizer import HFTokenizer

__all__ = ["GGUFTokenizer", "build_gguf_tokenizer", "byte_alphabet", "gguf_chat_template"]

_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact"})
_GPT2 = frozenset({"gpt-2", "mpt", "olmo", "jais"})
_CONTROL, _USER_DEFINED = 3, 4


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the rest
    (controls, space, soft hyphen...) take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spelled(token: str, alphabet: frozenset[str]) -> str:
    """A vocabulary entry in the byte alphabet (a file may store a token as raw text)."""
    if set(token) <= alphabet:
        return token
    table = byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _pre_tokenizer(name: str | None, source: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _GPT2:
        return byte_level
    known = ", ".join(sorted(_DIGITS_THEN_GPT2 | _GPT2))
    raise CheckpointError(f"{source}: tokenizer.ggml.pre {name!r} is not supported (known: {known})")


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    out = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    return out


def build_gguf_tokenizer(gf: GGUFFile) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the byte-level BPE described by ``gf``'s metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE

    meta, source = gf.metadata, gf.path.name
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                              f"byte-level BPE)")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens and tokenizer.ggml.merges are required")
    alphabet = frozenset(byte_alphabet().values())
    vocab = {_spelled(t, alphabet): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), source)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    ids = _special_ids(meta)
    add = [n for n in ("bos", "eos") if meta.get(f"tokenizer.ggml.add_{n}_token") and n in ids]
    if add:
        single = " ".join(([tokens[ids["bos"]]] if "bos" in add else []) + ["$A"]
                          + ([tokens[ids["eos"]]] if "eos" in add else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(tokens[ids[n]], ids[n]) for n in add])
    return tok


def gguf_chat_template(path: str | Path | GGUFFile) -> tuple[str | None, dict[str, str]]:
    """The file's Jinja chat template (None if it has none) and the special tokens it may refer to
    (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``), as ``apply_chat_template`` passes them."""
    gf = path if isinstance(path, GGUFFile) else open_gguf(path)
    tokens = gf.metadata.get("tokenizer.ggml.tokens") or []
    specials = {f"{name}_token": tokens[i] for name, i in _special_ids(gf.metadata).items() if i < len(tokens)}
    source = gf.metadata.get("tokenizer.chat_template")
    return (source if isinstance(source, str) else None), specials


class GGUFTokenizer(HFTokenizer):
    """``HFTokenizer``'s interface over the tokenizer built from a GGUF file's metadata."""

    def __init__(self, path: str | Path, eos_token_ids: Sequence[int] | None = None) -> None:
        gf = open_gguf(path)
        self.path = str(path)
        self._tok = build_gguf_tokenizer(gf)
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else gguf_eos_ids(gf)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        ids = _special_ids(gf.metadata)
        self.bos_token_id = ids.get("bos")
        self.pad_token_id = ids.get("pad")

    def __repr__(self) -> str:
        return f"GGUFTokenizer({self.path!r})"
