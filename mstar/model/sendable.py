"""Which classes may cross process boundaries (runtime messages, a family's typed request), under
which stable tags.

A class becomes sendable by ``@register_message`` (``mstar.runtime.wire.serialization`` encodes a
registered dataclass or enum by its tag and decodes only registered tags, never arbitrary classes).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["is_registered", "message_tag", "register_message"]

T = TypeVar("T")


_REGISTRY_LOCK = threading.Lock()
_TAG_TO_CLS: dict[str, type] = {}
_CLS_TO_TAG: dict[type, str] = {}
# name, has_default, default, default_factory (or None)
_FieldSpec = tuple[str, bool, Any, Callable[[], Any] | None]
_DC_FIELDS: dict[type, tuple[_FieldSpec, ...]] = {}


def register_message(cls: type[T] | None = None, /, *, tag: str | None = None) -> Any:
    """Class decorator: allow instances of a dataclass or an ``Enum`` subclass to be sent.

    Use as ``@register_message`` (tag = the class ``__qualname__``) or
    ``@register_message(tag="...")`` to pick a stable tag explicitly (e.g. when two modules
    define classes with the same qualname).  Registering a different class under a tag already
    in use raises :class:`ValueError`; registering the very same class again is a no-op.
    Returns the class unchanged.
    """

    def wrap(c: type[T]) -> type[T]:
        _register(c, tag)
        return c

    if cls is None:
        return wrap
    return wrap(cls)


def _register(cls: type, tag: str | None) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"register_message expects a class, got {cls!r}")
    is_enum = issubclass(cls, enum.Enum)
    if not is_enum and not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_message: {cls.__qualname__} must be a dataclass or an enum.Enum subclass")
    if tag is None:
        tag = cls.__qualname__
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"register_message: tag must be a non-empty str, got {tag!r}")
    with _REGISTRY_LOCK:
        existing = _TAG_TO_CLS.get(tag)
        if existing is cls:
            return
        if existing is not None:
            raise ValueError(
                f"register_message: tag {tag!r} is already used by {existing.__module__}."
                f"{existing.__qualname__}; cannot register {cls.__module__}.{cls.__qualname__} "
                f"(pass an explicit tag=...)"
            )
        if cls in _CLS_TO_TAG:
            raise ValueError(
                f"register_message: {cls.__qualname__} is already registered with tag {_CLS_TO_TAG[cls]!r}"
            )
        if not is_enum:
            specs = []
            for f in dataclasses.fields(cls):
                has_default = f.default is not dataclasses.MISSING
                factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
                specs.append((f.name, has_default, f.default if has_default else None, factory))
            _DC_FIELDS[cls] = tuple(specs)
        _TAG_TO_CLS[tag] = cls
        _CLS_TO_TAG[cls] = tag


def is_registered(cls: type) -> bool:
    """True when ``cls`` was registered with :func:`register_message`."""
    return cls in _CLS_TO_TAG


def message_tag(cls: type) -> str:
    """The type tag ``cls`` was registered under (``KeyError`` when it is not registered)."""
    return _CLS_TO_TAG[cls]
