"""Paged-attention backends behind one interface, and their lazy registry.

``torch`` (the reference kernel of ``mstar.layers.paged_attention``) is always there; others are
registered by name (``register_backend``, with the packages they need) and imported only when asked
for, so an install never imports a package it does not use. ``compiled`` (``mstar.layers.paged_decode``)
runs decode rows through a C++ kernel built at first use and is the default (``default_backend``);
``MSTAR_ATTENTION_KERNEL=torch`` (or ``MSTAR_KERNELS=torch``, every compiled kernel) selects the
reference instead.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from mstar.layers.cpu_build import compiled_attention_enabled, compiled_kernels_enabled
from mstar.layers.paged_attention import AttentionMetadata, copy_blocks, paged_attention

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "TorchPagedBackend",
    "available_backends",
    "compiled_attention_enabled",
    "compiled_kernels_enabled",
    "default_backend",
    "get_backend",
    "register_backend",
]


class BackendUnavailableError(ImportError):
    """A registered attention backend cannot be used here (its package or implementation is missing)."""


class AttentionBackend(ABC):
    """An implementation of paged attention; must honour the ``AttentionMetadata`` contract."""

    name: str = "abstract"

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
        """Same contract as :func:`paged_attention`."""

    def copy_blocks(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    pairs: Sequence[tuple[int, int]]) -> None:
        copy_blocks(k_cache, v_cache, pairs)


class TorchPagedBackend(AttentionBackend):
    """Pure-PyTorch reference backend (any device; clarity over speed). Bitwise batch invariant: a
    sequence's output does not depend on the rest of the batch (see ``mstar.layers.paged_attention``)."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale=None):
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)


# name -> ("module:attr" of the backend class, packages it needs). Imported only when requested.
_REGISTRY: dict[str, tuple[str, tuple[str, ...]]] = {
    "torch": ("mstar.layers.attention_backends:TorchPagedBackend", ()),
    "compiled": ("mstar.layers.paged_decode:CompiledPagedBackend", ()),
}
_INSTANCES: dict[str, AttentionBackend] = {}


def register_backend(name: str, target: str, requires: Sequence[str] = ()) -> None:
    """Register (or replace) a backend lazily: ``target`` is ``"package.module:ClassName"``."""
    if ":" not in target:
        raise ValueError(f"backend target must be 'module:Class', got {target!r}")
    _REGISTRY[name] = (target, tuple(requires))
    _INSTANCES.pop(name, None)


def available_backends() -> list[str]:
    """Registered backends whose required packages are installed (their modules are not imported)."""
    return [name for name, (_, requires) in _REGISTRY.items()
            if all(importlib.util.find_spec(pkg) is not None for pkg in requires)]


def get_backend(name: str = "torch") -> AttentionBackend:
    """The (cached) backend instance for ``name``; its module is imported only now.

    Raises ValueError for an unknown name and :class:`BackendUnavailableError` if the backend's package or
    implementation module is not installed.
    """
    if name in _INSTANCES:
        return _INSTANCES[name]
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_REGISTRY)}")
    target, requires = _REGISTRY[name]
    for pkg in requires:
        if importlib.util.find_spec(pkg) is None:
            raise BackendUnavailableError(
                f"attention backend {name!r} needs the {pkg!r} package, which is not installed; "
                f"install it or use get_backend('torch')")
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise BackendUnavailableError(
            f"attention backend {name!r} could not be imported ({exc}); use get_backend('torch')") from exc
    cls = getattr(module, attr)
    backend = cls()
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"{target} is not an AttentionBackend")
    _INSTANCES[name] = backend
    return backend


def default_backend() -> AttentionBackend:
    """What models use unless told otherwise: ``compiled`` (it falls back to the reference path by
    itself where its kernel cannot run), or ``torch`` when ``MSTAR_ATTENTION_KERNEL=torch`` or
    ``MSTAR_KERNELS=torch``."""
    return get_backend("compiled" if compiled_attention_enabled() else "torch")
