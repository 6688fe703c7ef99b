"""A model's tokenizer, loaded on first use and never pickled with the model."""

from __future__ import annotations

from typing import Any

__all__ = ["LazyTokenizer"]


class LazyTokenizer:
    """Mixin for a ``ModelDef`` (listed before it) whose ``tokenizer`` is built by ``_load_tokenizer``
    the first time it is read.

    Drawing a graph or starting workers then needs no tokenizer files, and a model sent to a worker
    process travels without it (a ``tokenizers`` object may not pickle): a process that needs one
    loads its own.
    """

    _tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # type: ignore[misc]
        state.pop("_tokenizer", None)
        return state
