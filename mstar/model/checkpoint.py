"""What every family's checkpoint loader shares: the error types, dtype names, and a strict copy of a
state dict into a module that reports every missing, unexpected and mis-shaped name at once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "DTYPES",
    "LOAD_FORMATS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "LoadReport",
    "check_load_format",
    "listed",
    "load_into",
    "mismatch_report",
    "reject_checkpoint",
    "resolve_dtype",
]

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
# "auto": read the checkpoint in the family's format; "dummy": seeded random weights, no files
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_MAX_LISTED = 20


class CheckpointError(ValueError):
    """The checkpoint does not fit the model (names, shapes) or cannot be read."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A model directory, config or weight file is missing."""


@dataclass
class LoadReport:
    """What a loader read into a model: the files, the tensors and their bytes, the seconds it took,
    and the entries it skipped (ignored names and tied duplicates)."""

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of: float32, bfloat16, float16")


def check_load_format(load_format: str, allowed: Sequence[str] = LOAD_FORMATS) -> str:
    if load_format not in allowed:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {', '.join(allowed)}")
    return load_format


def reject_checkpoint(tiny: str, full: str, model_path: object, load_format: str) -> None:
    """A tiny twin (``tiny``) has no checkpoint: a model path, or a load format other than "dummy", is an
    error that points at the full model (``full``)."""
    if model_path is not None or load_format != "dummy":
        raise ValueError(f"{tiny} has no checkpoint: it always uses dummy weights "
                         f"(use the '{full}' model with --model-path for a checkpoint)")


def listed(names: Sequence[str]) -> str:
    """Names for an error message: the first 20, then how many more."""
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def mismatch_report(problems: Iterable[tuple[str, Sequence[str]]]) -> str:
    """Every kind of mismatch at once, ``"missing: a, b; shape mismatch: c"``: one ``label: names`` part
    per ``(label, names)`` that has names; "" when none has."""
    return "; ".join(f"{label}: {listed(names)}" for label, names in problems if names)


def load_into(module: nn.Module, state: Mapping[str, torch.Tensor], *, what: str = "checkpoint",
              ignore: Iterable[str] = ()) -> None:
    """Copy ``state`` into ``module`` strictly: missing, unexpected and mis-shaped names are all reported
    in one ``CheckpointError`` before anything is copied. Keys starting with an ``ignore`` prefix are
    skipped (for checkpoint extras the module does not model); values are cast to the module's dtypes.
    """
    ignore = tuple(ignore)
    state = {k: v for k, v in state.items() if not (ignore and k.startswith(ignore))}
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)})"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    report = mismatch_report([("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)])
    if report:
        raise CheckpointError(f"{what} does not fit {type(module).__name__}: {report}")
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(state[k].to(v.dtype))
