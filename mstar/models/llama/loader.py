"""Build a ``LlamaCausalLM`` and fill its weights: a Hugging Face safetensors checkpoint or dummy values.

Checkpoints: ``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (a ``.gguf``
file is read by ``gguf_loader.py`` instead, with the same strictness). Loading
is strict and name-for-name (the module mirrors the checkpoint layout): every tensor header is
checked first (missing, unexpected and mis-shaped names are all reported in one error, before
any data is read), then the shards are copied in one by one, converted to the requested dtype.
Tied parameters (``lm_head.weight`` is ``model.embed_tokens.weight`` under
``tie_word_embeddings``) need only one of their names in the checkpoint; when both are present the
first-registered name (the embedding) wins, as transformers does.

``load_format="dummy"`` skips the checkpoint: weights are drawn from a generator with a fixed seed
(so every rank of a placement builds the same model), norms set to one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mstar.layers.norms import RMSNorm
from mstar.layers.prepack import prepack_linears, prepack_requested
from mstar.model.checkpoint import (
    DTYPES,
    CheckpointError,
    CheckpointNotFoundError,
    LoadReport,
    check_load_format,
    listed,
    mismatch_report,
    resolve_dtype,
)
from mstar.model.gguf_file import is_gguf_path, open_gguf
from mstar.models.llama.config import LlamaConfig, read_json
from mstar.models.llama.gguf_loader import load_gguf_stored, load_gguf_weights, stored_blocker
from mstar.models.llama.nodes import LlamaCausalLM

log = logging.getLogger(__name__)

__all__ = [
    "DTYPES",
    "LOAD_FORMATS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "LoadReport",
    "build_llama_model",
    "check_load_format",
    "checkpoint_files",
    "init_dummy_weights",
    "load_safetensors",
    "resolve_dtype",
]

LOAD_FORMATS = ("auto", "safetensors", "dummy")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# checkpoint entries that are recomputed, not loaded (old transformers saved the RoPE table)
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order."""
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must be a non-empty mapping of tensor name -> "
                                  f"shard file")
        shards = list(dict.fromkeys(str(v) for v in weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointNotFoundError(f"{index} lists shard file(s) that are missing: {listed(missing)}")
        return [path / s for s in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    legacy = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
    hint = f" (found {listed(legacy)}: only safetensors checkpoints are supported)" if legacy else ""
    raise CheckpointNotFoundError(f"no weights in {str(path)!r}: expected {SINGLE_FILE} or "
                                  f"{INDEX_FILE}{hint}")


def _targets(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[str]]]:
    """Every loadable name -> tensor (tied names included) and the names of each distinct tensor."""
    state = module.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    return state, groups


def load_safetensors(module: torch.nn.Module, files: Iterable[str | Path]) -> LoadReport:
    """Copy a safetensors checkpoint into ``module`` by name (strict; see the module docstring)."""
    try:
        from safetensors import safe_open  # noqa: F401 - checked here, used by the two passes
    except ImportError as e:  # pragma: no cover - safetensors ships with the serving extras
        raise ImportError("loading checkpoints needs the 'safetensors' package "
                          "(pip install safetensors)") from e

    files = [Path(f) for f in files]
    state, groups = _targets(module)
    report = LoadReport(files=[str(f) for f in files])
    source = _plan_sources(module, files, state, groups, report)
    _copy_shards(files, source, state, groups, report)
    if report.skipped:
        log.debug("skipped checkpoint entries: %s", listed(report.skipped))
    return report


def _plan_sources(module: torch.nn.Module, files: list[Path], state: dict[str, torch.Tensor],
                  groups: dict[int, list[str]], report: LoadReport) -> dict[int, tuple[Path, str]]:
    """Pass 1, headers only: the (file, name) each distinct tensor is loaded from. Every mismatch is
    reported at once, in one ``CheckpointError``, before any data is read."""
    from safetensors import safe_open

    canonical = {key: names[0] for key, names in groups.items()}
    source: dict[int, tuple[Path, str]] = {}
    seen: dict[str, Path] = {}
    unexpected: list[str] = []
    bad_shapes: list[str] = []
    duplicates: list[str] = []
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - name the file in the error
            raise CheckpointError(f"cannot read safetensors file {str(f)!r}: {e}") from e
        with handle as st:
            for name in st.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    report.skipped.append(name)
                    continue
                if name in seen:
                    duplicates.append(f"{name} ({seen[name].name} and {f.name})")
                    continue
                seen[name] = f
                target = state.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                shape = tuple(st.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    bad_shapes.append(f"{name}: checkpoint {list(shape)} vs model {list(target.shape)}")
                    continue
                key = id(target)
                if key not in source or name == canonical[key]:
                    if key in source:
                        report.skipped.append(source[key][1])
                    source[key] = (f, name)
                else:
                    report.skipped.append(name)
    missing = [names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"
               for key, names in groups.items() if key not in source]
    problems = mismatch_report([("missing from the checkpoint", missing),
                                ("not in the model (unexpected)", unexpected),
                                ("shape mismatch", bad_shapes), ("stored in several files", duplicates)])
    if problems:
        where = files[0].parent if files else "?"
        raise CheckpointError(f"checkpoint {str(where)!r} does not match {type(module).__name__}: {problems}")
    return source


def _copy_shards(files: list[Path], source: dict[int, tuple[Path, str]], state: dict[str, torch.Tensor],
                 groups: dict[int, list[str]], report: LoadReport) -> None:
    """Pass 2: the data, shard by shard, each tensor copied (and cast) into its parameter."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for key, (f, name) in source.items():
        by_file.setdefault(f, []).append((name, state[groups[key][0]]))
    t_all = time.perf_counter()
    for i, f in enumerate(files, 1):
        items = by_file.get(f, [])
        t0 = time.perf_counter()
        nbytes = 0
        with safe_open(str(f), framework="pt", device="cpu") as st, torch.no_grad():
            for name, target in items:
                tensor = st.get_tensor(name)
                target.copy_(tensor)
                nbytes += tensor.numel() * tensor.element_size()
        report.tensors += len(items)
        report.bytes += nbytes
        log.info("loaded shard %d/%d %s: %d tensors, %.1f MiB in %.2f s", i, len(files), f.name, len(items),
                 nbytes / 2**20, time.perf_counter() - t0)
    report.seconds = time.perf_counter() - t_all


def init_dummy_weights(module: torch.nn.Module, seed: int = 0, std: float | None = None) -> None:
    """Deterministic random weights, drawn in registration order; RMSNorm weights = 1.

    Each parameter is normal with standard deviation ``std``, by default ``1 / sqrt(fan_in)`` (its
    last dimension; ``1 / sqrt(hidden)`` for the embedding), which keeps activations and logits of
    order one, so even a tiny dummy model gives prompt-dependent, non-degenerate text. Values are
    drawn in float32 and then cast: every dtype gets (a rounding of) the same model.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = std if std is not None else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * scale)
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)


def build_llama_model(config: LlamaConfig, *, model_path: str | Path | None = None, load_format: str = "auto",
                      dtype: str | torch.dtype = "float32", eos_token_ids: Iterable[int] | None = None,
                      seed: int = 0,
                      module_cls: type | None = None, prepack: bool | None = None,
                      weights_as_stored: bool = False) -> Any:
    """A ``LlamaCausalLM`` (or ``module_cls``, a subclass) on CPU with its weights (from ``model_path``
    unless ``load_format="dummy"``).

    The module is created without initialising its parameters (on the meta device) and then
    materialised, so building a large model costs one copy of its weights. With ``prepack=True``
    (``None``: unless ``MSTAR_PREPACK=0``) the projections are then prepacked
    (``mstar.layers.prepack``), which keeps a second copy of those weights.

    ``weights_as_stored=True`` (a GGUF file whose projections, embedding and head are Q8_0 / Q4_0 /
    Q4_1: ``gguf_loader.stored_blocker``): those stay quantized as the file stores them and are
    multiplied as stored (``gguf_loader.load_gguf_stored``; ``dtype`` is then the activations' and
    the KV cache's); False (the default) dequantizes every tensor to ``dtype``. Only
    ``LlamaCausalLM`` itself keeps them (a subclass may compute its logits its own way).
    """
    check_load_format(load_format, LOAD_FORMATS)
    torch_dtype = resolve_dtype(dtype)
    files: list[Path] = []
    if load_format != "dummy":
        if model_path is None:
            raise CheckpointError("a model_path (checkpoint directory) is required unless "
                                  "load_format='dummy'")
        files = [] if is_gguf_path(model_path) else checkpoint_files(model_path)
    module = (module_cls or LlamaCausalLM)(config, dtype=torch_dtype, device="meta", eos_token_ids=eos_token_ids)
    if weights_as_stored:
        if load_format == "dummy" or not is_gguf_path(model_path):
            raise CheckpointError("weights as stored need a GGUF checkpoint (a .gguf model_path)")
        why = stored_blocker(open_gguf(model_path), config)
        if why is None and type(module) is not LlamaCausalLM:
            why = f"{type(module).__name__} computes its own logits"
        if why is not None:
            raise CheckpointError(f"cannot keep {Path(model_path).name}'s weights as stored: {why}")
        load_gguf_stored(module, model_path, config)
        if prepack_requested(prepack):
            prepack_linears(module)  # the norms' compiled kernels
        return module.eval()
    module.to_empty(device="cpu")
    module.tie_weights()
    module.pack_weights()
    if load_format == "dummy":
        init_dummy_weights(module, seed)
        log.info("initialised dummy Llama weights (seed %d, %s)", seed, torch_dtype)
    elif is_gguf_path(model_path):
        load_gguf_weights(module, model_path, config)
    else:
        report = load_safetensors(module, files)
        log.info("loaded %s: %d tensors, %.1f MiB from %d file(s) in %.2f s (%s)", model_path, report.tensors,
                 report.bytes / 2**20, len(files), report.seconds, torch_dtype)
    if prepack_requested(prepack):
        prepack_linears(module)
    return module.eval()
