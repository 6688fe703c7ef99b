"""Models addressable by name (``"orpheus-tiny"``) or by ``module:Class``.

The registry stores import paths, not classes, so listing models imports nothing heavy; a
family's module is imported only when its model is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from mstar.model.base import ModelDef

_REGISTRY: dict[str, str] = {}


def register_model(name: str, target: str) -> None:
    """Register ``name`` -> ``"package.module:ClassOrFactory"`` (called with no arguments)."""
    if ":" not in target:
        raise ValueError(f"model target must look like 'package.module:Class', got {target!r}")
    if name in _REGISTRY and _REGISTRY[name] != target:
        raise ValueError(f"model name {name!r} is already registered to {_REGISTRY[name]}")
    _REGISTRY[name] = target


def registered_models() -> dict[str, str]:
    _load_builtin()
    return dict(sorted(_REGISTRY.items()))


def _load_builtin() -> None:
    from mstar.models import BUILTIN_MODELS  # the families shipped with mstar (a torch-free table)

    for name, target in BUILTIN_MODELS.items():
        register_model(name, target)


def import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for model {target!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_model(spec: str | ModelDef | type, **kwargs: Any) -> ModelDef:
    """A ``ModelDef`` from an instance, a class, a registered name or ``module:Class``."""
    if isinstance(spec, ModelDef):
        return spec
    if isinstance(spec, type):
        obj: Any = spec
    elif isinstance(spec, str):
        _load_builtin()
        if spec in _REGISTRY:
            obj = import_target(_REGISTRY[spec])
        elif ":" in spec:
            obj = import_target(spec)
        else:
            known = ", ".join(sorted(_REGISTRY)) or "none"
            raise ValueError(f"unknown model {spec!r}: not a registered name ({known}) nor 'module:Class'")
    else:
        raise TypeError(f"cannot resolve a model from {type(spec).__name__}")
    model = obj(**kwargs) if callable(obj) else obj
    if not isinstance(model, ModelDef):
        raise ValueError(f"{spec!r} did not produce a ModelDef (got {type(model).__name__})")
    return model
