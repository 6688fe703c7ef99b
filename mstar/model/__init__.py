"""Model-definition surface: ModelDef, NodeSubmodule, NodeInputs and the model registry."""

from mstar.layers.paged_attention import QueryMode
from mstar.model.base import ModelDef, WalkState
from mstar.model.registry import register_model, registered_models, resolve_model
from mstar.model.submodule import (
    EngineInputs,
    ForwardInfo,
    KVSequence,
    KVSpec,
    NodeInputs,
    NodeSubmodule,
)

__all__ = [
    "QueryMode",
    "EngineInputs",
    "ForwardInfo",
    "KVSequence",
    "KVSpec",
    "ModelDef",
    "NodeInputs",
    "NodeSubmodule",
    "WalkState",
    "register_model",
    "registered_models",
    "resolve_model",
]
