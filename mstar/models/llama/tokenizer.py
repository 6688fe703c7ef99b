"""Tokenizers of the Llama family: a checkpoint's ``tokenizer.json`` or, offline, a byte tokenizer.

Both expose ``encode(text, add_special_tokens=True) -> list[int]``, ``decode(ids,
skip_special_tokens=True) -> str``, ``eos_token_ids``, ``bos_token_id``, ``pad_token_id`` and
``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mstar.model.checkpoint import CheckpointNotFoundError
from mstar.model.gguf_file import open_gguf
from mstar.models.llama.config import gguf_eos_ids, read_json
from mstar.models.llama.gguf_tokenizer import GGUFTokenizer
from mstar.models.llama.hf_tokenizer import HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "checkpoint_eos_ids", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 3; pad 0, bos 1, eos 2 (259 ids). Needs no files."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    vocab_size = 256 + 3
    eos_token_ids: tuple[int, ...] = (2,)
    special_token_ids = (0, 1, 2)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Invalid UTF-8 (e.g. a character cut in the middle of a stream) decodes as U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if self.offset <= i < self.vocab_size:
                out.append(i - self.offset)
            elif not skip_special_tokens:
                raise ValueError(f"token id {i} is not a byte token (special or out of range) and "
                                 f"skip_special_tokens is False")
        return out.decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id (the specials named), for a grammar engine's vocabulary."""
        return [b"<pad>", b"<s>", b"</s>", *(bytes([b]) for b in range(256))]

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def checkpoint_eos_ids(model_path: str | Path) -> tuple[int, ...]:
    """The EOS ids generation stops on: ``generation_config.json``'s if it names some (as transformers'
    ``generate`` uses them), else ``config.json``'s; for a ``.gguf`` file, the ids its metadata names."""
    if str(model_path).lower().endswith(".gguf"):
        return gguf_eos_ids(open_gguf(model_path))
    path = Path(model_path)
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            ids = _ids(read_json(f, name).get("eos_token_id"))
            if ids:
                return ids
    return ()


def load_tokenizer(model_path: str | Path, eos_token_ids: Sequence[int] | None = None) -> HFTokenizer:
    """The tokenizer of a checkpoint directory (its ``tokenizer.json``) or of a ``.gguf`` file (its metadata)."""
    if str(model_path).lower().endswith(".gguf"):
        return GGUFTokenizer(model_path, eos_token_ids)
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointNotFoundError(f"no tokenizer.json in {str(path)!r} (only the fast-tokenizer "
                                      f"format is supported)")
    cfg = read_json(path / "config.json", "config.json") if (path / "config.json").is_file() else {}
    bos = cfg.get("bos_token_id")
    pad = cfg.get("pad_token_id")
    eos = tuple(eos_token_ids) if eos_token_ids is not None else checkpoint_eos_ids(path)
    return HFTokenizer(tok_file, eos, bos if isinstance(bos, int) else None,
                       pad if isinstance(pad, int) else None)
