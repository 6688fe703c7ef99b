"""``ReadDict``: a request's fields or parameters that remember which keys were read, so that what
nobody read can be refused by name instead of accepted and ignored (the server's routes, over a parsed
body; ``Runtime.submit``, over a request's params)."""

from __future__ import annotations

from typing import Any

__all__ = ["ReadDict"]


class ReadDict(dict):
    """A dict recording every key looked up (``[]``, ``get``, ``in``); ``with_changes`` copies it
    sharing what was read. Copying it (``dict(d)``, ``{**d}``) is not reading it."""

    def __init__(self, data: dict[str, Any], read: set[str] | None = None) -> None:
        super().__init__(data)
        self.read: set[str] = set() if read is None else read

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)

    def with_changes(self, **changes: Any) -> ReadDict:
        return ReadDict({**self, **changes}, self.read)

    def unread(self) -> list[str]:
        """The keys holding a value (not None) that nothing read."""
        return sorted(k for k, v in dict.items(self) if v is not None and k not in self.read)
