"""Llama checkpoints in llama.cpp's GGUF format: the weights dequantized at load (the config from the
metadata: ``config.llama_config_from_gguf``).

The tensors are renamed to the Hugging Face names ``LlamaCausalLM`` mirrors (``blk.3.attn_q.weight``
-> ``model.layers.3.self_attn.q_proj.weight``, ``token_embd.weight`` -> ``model.embed_tokens.weight``,
``output.weight`` -> ``lm_head.weight``...) and then loaded as a safetensors checkpoint is: strictly,
every missing, unexpected, mis-shaped or unsupported tensor reported in one ``CheckpointError``
before any data is dequantized, then one tensor at a time (dequantized to float32, cast to the
module's dtype by the copy), so loading costs one extra tensor of memory, not one extra model.

llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` inside each head (its RoPE pairs
dimensions ``(2i, 2i + 1)``, transformers' pairs ``(i, i + D/2)``); ``unpermute_rows`` undoes that.
A file without ``output.weight`` has tied embeddings (llama.cpp writes the LM head only when it is
not the embedding matrix).

Weights as stored (``load_gguf_stored``, the default for a file whose projections, embedding and
head are all Q8_0 / Q4_0 / Q4_1): those tensors are kept in their blocks and multiplied as stored
(``mstar.layers.quant``); only the norms are materialised in float. ``stored_blocker`` says why a
file cannot be served that way (its tensors are then dequantized).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from mstar.layers.prepack import held_weight_bytes
from mstar.layers.quant import QUANT_KINDS, QuantizedEmbedding, QuantizedLinear, QuantizedWeight
from mstar.model.checkpoint import CheckpointError, LoadReport, listed
from mstar.model.gguf_file import GGUFFile, is_gguf_path, open_gguf
from mstar.models.llama.config import LlamaConfig, gguf_eos_ids, llama_config_from_gguf

log = logging.getLogger(__name__)

__all__ = ["gguf_eos_ids", "gguf_hf_name", "hf_tensors", "is_gguf_path", "llama_config_from_gguf", "load_gguf_stored",
           "load_gguf_weights", "stored_blocker", "unpermute_rows"]

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_hf_name(name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor, or None when Llama has no such tensor."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows ``(2i, 2i + 1)`` go back to ``(i, i + D/2)``."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise CheckpointError(f"cannot undo the q/k row permutation: {rows} rows is not a multiple of "
                              f"2 x {num_heads} heads")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# -- weights ---------------------------------------------------------------------------------------
def _plan(module: torch.nn.Module, gf: GGUFFile) -> tuple[dict[str, str], list[str]]:
    """GGUF name -> module name of every tensor to load; raises with every mismatch at once."""
    state = module.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    source: dict[int, tuple[str, str]] = {}  # tensor -> (gguf name, module name)
    skipped, unexpected, shapes, types = [], [], [], []
    reported: set[int] = set()  # targets whose tensor is mis-shaped or of an unsupported type
    for name in gf.tensor_names:
        hf = gguf_hf_name(name)
        target = state.get(hf) if hf is not None else None
        if target is None:
            unexpected.append(name if hf is None else f"{name} (as {hf})")
            continue
        if gf.shape(name) != tuple(target.shape):
            shapes.append(f"{name} (as {hf}): checkpoint {list(gf.shape(name))} vs model {list(target.shape)}")
            reported.add(id(target))
            continue
        if (why := gf.unsupported_type(name)) is not None:
            types.append(why)
            reported.add(id(target))
            continue
        key = id(target)
        if key in source and hf != groups[key][0]:
            skipped.append(name)  # a tied duplicate: the first-registered name wins
            continue
        if key in source:
            skipped.append(source[key][0])
        source[key] = (name, hf)
    missing = [names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"
               for key, names in groups.items() if key not in source and key not in reported]
    problems = [f"{what}: {listed(items)}" for what, items in (
        ("missing from the checkpoint", missing), ("not in the model (unexpected)", unexpected),
        ("shape mismatch", shapes), ("unsupported tensor type", types)) if items]
    if problems:
        raise CheckpointError(f"GGUF file {str(gf.path)!r} does not match {type(module).__name__}: "
                              + "; ".join(problems))
    return dict(source.values()), skipped


def hf_tensors(gf: GGUFFile, config: LlamaConfig, names: Iterable[str] | None = None
               ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(gguf name, HF name, float32 tensor in HF layout)`` of each tensor (``names``, or every tensor of
    the file; one Llama has no name for is an error), one at a time: dequantized, q/k rows back in
    transformers' order."""
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name in gf.tensor_names if names is None else names:
        hf = gguf_hf_name(name)
        if hf is None:
            raise CheckpointError(f"{gf.path.name}: tensor {name} is not part of a Llama model")
        tensor = gf.tensor(name)
        kind = name.split(".")[-2]
        if kind in heads:
            tensor = unpermute_rows(tensor, heads[kind])
        yield name, hf, tensor


def load_gguf_weights(module: torch.nn.Module, path: str | Path | GGUFFile, config: LlamaConfig) -> LoadReport:
    """Copy a GGUF file's tensors into a ``LlamaCausalLM`` (strict; see the module docstring)."""
    gf = path if isinstance(path, GGUFFile) else open_gguf(path)
    plan, skipped = _plan(module, gf)
    state = module.state_dict(keep_vars=True)
    report = LoadReport(files=[str(gf.path)], skipped=skipped)
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, hf, tensor in hf_tensors(gf, config, plan):
            state[hf].copy_(tensor)
            report.tensors += 1
            report.bytes += gf.nbytes(name)
    gf.release_pages()  # the values were copied: the file's pages need not stay resident
    report.seconds = time.perf_counter() - t0
    log.info("loaded %s: %d tensors (%.1f MiB in the file) dequantized in %.2f s", gf.path.name, report.tensors,
             report.bytes / 2**20, report.seconds)
    return report


# -- weights as stored -----------------------------------------------------------------------------
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def stored_blocker(gf: GGUFFile, config: LlamaConfig) -> str | None:
    """Why the file's weights cannot be kept as stored (a tensor that is not Q8_0 / Q4_0 / Q4_1,
    named), or None when they can."""
    names = [f"blk.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in _PROJECTIONS]
    names.append("token_embd.weight")
    if "output.weight" in gf.tensor_names:
        names.append("output.weight")
    for name in names:
        if name in gf.tensor_names and gf.type_name(name) not in QUANT_KINDS:
            return f"{name} is {gf.type_name(name)} (kept as stored: {', '.join(QUANT_KINDS)})"
    return None


def _stored(gf: GGUFFile, config: LlamaConfig, name: str) -> QuantizedWeight:
    """A tensor's blocks, q/k rows back in transformers' order (rows are whole output features)."""
    weight = QuantizedWeight.from_bytes(gf.type_name(name), gf.raw(name), gf.shape(name))
    kind = name.split(".")[-2]
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    if kind in heads:
        weight = QuantizedWeight(weight.kind, unpermute_rows(weight.blocks, heads[kind]))
    return weight


def _group(gf: GGUFFile, config: LlamaConfig, names: list[str], *, silu_mul: bool = False) -> QuantizedLinear:
    parts = [_stored(gf, config, n) for n in names]
    if len({p.kind for p in parts}) != 1:
        raise CheckpointError(f"{gf.path.name}: {', '.join(names)} have different types "
                              f"({', '.join(p.kind for p in parts)}); serve it with --no-weights-as-stored")
    return QuantizedLinear(QuantizedWeight.cat(parts), silu_mul=silu_mul)


def load_gguf_stored(module: torch.nn.Module, path: str | Path | GGUFFile, config: LlamaConfig) -> LoadReport:
    """Load a ``LlamaCausalLM`` built on the meta device with its projections, embedding and head kept
    quantized as stored (``stored_blocker`` must be None): those modules' parameters become empty
    tensors, unused; every other parameter (the norms) is materialised and loaded. Strict as
    ``load_gguf_weights`` (the file's tensors must match the model)."""
    gf = path if isinstance(path, GGUFFile) else open_gguf(path)
    why = stored_blocker(gf, config)
    if why is not None:
        raise CheckpointError(f"{gf.path.name}: cannot keep the weights as stored: {why}")
    plan, skipped = _plan(module, gf)
    report = LoadReport(files=[str(gf.path)], skipped=skipped)
    t0 = time.perf_counter()
    backbone = module.model
    quantized_modules = {id(backbone.embed_tokens), id(module.lm_head)}
    for layer in backbone.layers:
        a, m = layer.self_attn, layer.mlp
        quantized_modules |= {id(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)}
    for sub in module.modules():
        if id(sub) not in quantized_modules:
            sub.to_empty(device="cpu", recurse=False)
            continue
        for pname, param in list(sub.named_parameters(recurse=False)):  # unused: empty, so .to() still works
            setattr(sub, pname, torch.nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False))
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, hf, tensor in hf_tensors(gf, config, [n for n in plan if gf.type_name(n) not in QUANT_KINDS]):
            state[hf].copy_(tensor)
            report.tensors += 1
            report.bytes += gf.nbytes(name)
    for i, layer in enumerate(backbone.layers):
        blk = f"blk.{i}."
        layer.self_attn.use_stored(_group(gf, config, [blk + p + ".weight" for p in ("attn_q", "attn_k", "attn_v")]),
                                   _group(gf, config, [blk + "attn_output.weight"]))
        layer.mlp.use_stored(_group(gf, config, [blk + "ffn_gate.weight", blk + "ffn_up.weight"], silu_mul=True),
                             _group(gf, config, [blk + "ffn_down.weight"]))
        report.tensors += len(_PROJECTIONS)
        report.bytes += sum(gf.nbytes(f"{blk}{p}.weight") for p in _PROJECTIONS)
    table = _group(gf, config, ["token_embd.weight"])
    head = _group(gf, config, ["output.weight"]) if "output.weight" in gf.tensor_names else table
    backbone.embed_tokens = QuantizedEmbedding(table)
    module.use_stored_head(head)
    report.tensors += 1 + (head is not table)
    report.bytes += gf.nbytes("token_embd.weight") + (gf.nbytes("output.weight") if head is not table else 0)
    gf.release_pages()  # the blocks were copied: the file's pages need not stay resident
    report.seconds = time.perf_counter() - t0
    log.info("loaded %s: %d tensors (%.1f MiB in the file) kept as stored (%s) in %.2f s; weights in memory %.1f MiB",
             gf.path.name, report.tensors, report.bytes / 2**20,
             ", ".join(sorted({gf.type_name(n) for n in gf.tensor_names})), report.seconds,
             held_weight_bytes(module) / 2**20)
    return report

