"""``HFTokenizer``: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (the base of the
GGUF file's tokenizer too, ``gguf_tokenizer``; both are picked by ``tokenizer.load_tokenizer``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None,
                 pad_token_id: int | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers ships with the serving extras
            raise ImportError("loading tokenizer.json needs the 'tokenizers' package "
                              "(pip install tokenizers)") from e
        self.path = str(path)
        try:
            self._tok: Any = Tokenizer.from_file(self.path)
        except Exception as e:  # noqa: BLE001 - name the file
            raise ValueError(f"cannot load tokenizer {self.path!r}: {e}") from e
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine builds its vocabulary from)."""
        return self._tok.to_str()

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"
