"""Prepacked linear layers: weights laid out once for fast CPU matrix multiplies.

``prepack_linears(module)`` is a transform of a built model (in the spirit of gpt-fast's
``apply_tp``): every submodule with a ``prepack()`` method (the Llama attention and MLP blocks, the
norms, the LLM node's head) switches to prepacked projections and compiled kernels. Two routes:

* ``panel`` (the default where the compiled kernels build, ``mstar.layers.cpu_ops``): weights as
  column panels, multiplied by mstar's kernel with a fixed accumulation order per output, so a
  row's result is the same bits in any batch and at any thread count; SiLU-mul and residual adds
  are fused into its stores. float32 and bfloat16 weights (bfloat16 ones through the CPU's bf16
  dot-product instructions where it has AVX512-BF16).
* ``onednn`` (``MSTAR_PREPACK=onednn``): PyTorch's own oneDNN path with weights reordered into its
  blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what
  inductor's weight freezing uses); float32 only, NOT batch invariant per row (a row alone and in
  a batch of 16 may round differently).

Each prepacked weight remembers the tensor it was packed from and that tensor's version counter,
so a module whose weights were changed afterwards (an in-place copy, a replaced parameter) goes
back to the plain path instead of using stale values. The packed copy doubles the memory of the
projection weights. ``MSTAR_PREPACK=0`` (or ``prepack=False`` in the loaders) keeps the plain path.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.cpu_ops import ops

__all__ = ["PrepackableLinear", "PrepackedGroup", "PrepackedLinear", "can_prepack", "held_weight_bytes", "hooked",
           "onednn_available",
           "prepack_available", "prepack_linears", "prepack_mode", "prepack_requested", "unchanged", "versions"]

log = logging.getLogger(__name__)

# oneDNN picks the packed layout for this many rows; any batch works. 16 is a full decode batch, the
# shape decode steps run at, and a layout picked for it does not penalise a single row.
BATCH_HINT = 16
_OFF = ("0", "false", "no", "off")


def onednn_available() -> bool:
    """PyTorch has the oneDNN linear ops (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepack_mode(flag: bool | None = None) -> str | None:
    """The route a loader should prepack with: ``"panel"``, ``"onednn"`` or None (plain).

    ``flag=False`` or ``MSTAR_PREPACK=0``: None. ``MSTAR_PREPACK=onednn``: oneDNN. Otherwise (the
    default, ``flag=True``, ``MSTAR_PREPACK=1``): the panel kernel, None where it cannot be built."""
    env = os.environ.get("MSTAR_PREPACK", "").strip().lower()
    if flag is False or (flag is None and env in _OFF):
        return None
    if env == "onednn":
        return "onednn" if onednn_available() else None
    return "panel" if ops() is not None else None


def prepack_requested(flag: bool | None = None) -> bool:
    """Whether a loader should prepack at all (``prepack_mode`` is not None)."""
    return prepack_mode(flag) is not None


def prepack_available() -> bool:
    """Some prepacked route can run here."""
    return ops() is not None or onednn_available()


def _route() -> str:
    """The route new prepacked weights take: ``prepack_mode(True)`` (oneDNN where nothing else runs)."""
    return prepack_mode(True) or "onednn"


class PrepackedLinear:
    """``x @ W.T`` for a weight ``W`` ``[out, in]`` (nn.Linear's layout; ``in_out=True``: ``source``
    is stored ``[in, out]`` and computes ``x @ source``) through a prepacked copy of it.

    ``silu_mul=True``: the weight holds ``[gate | up]`` output columns and the call returns
    ``silu(gate) * up``. ``__call__(x, residual)`` adds ``residual`` to the result."""

    def __init__(self, source: torch.Tensor, *, in_out: bool = False, silu_mul: bool = False,
                 mode: str | None = None) -> None:
        if mode not in (None, "panel", "onednn"):
            raise ValueError(f"unknown prepack route {mode!r} (panel, onednn)")
        self.source = source
        self.stamp = (source._version, source.data_ptr())
        self.silu_mul = silu_mul
        self.mode = mode or _route()
        with torch.no_grad():
            w = source.detach()
            if self.mode == "panel":
                self._kernel = ops()  # the build the weight was packed for (looked up once, not per call)
                in_out_w = (w if in_out else w.t()).contiguous()
                self.n_out = in_out_w.shape[1] // (2 if silu_mul else 1)
                # bfloat16 weights multiply through the CPU's bf16 dot products where it has them
                pairs = (w.dtype == torch.bfloat16 and in_out_w.shape[0] % 2 == 0
                         and self._kernel.dot_pairs_available())
                self.packed = self._kernel.pack(in_out_w, silu_mul, pairs)
            else:
                out_in = (w.t() if in_out else w).contiguous()
                self.n_out = out_in.shape[0]
                self.packed = torch.ops.mkldnn._reorder_linear_weight(out_in, BATCH_HINT)

    def fresh(self, source: torch.Tensor | None) -> bool:
        """Packed from this very tensor, which has not changed since: the same version (in-place
        writes through it) and storage (``param.data = new``). A write through ``param.data`` in
        place (``param.data.copy_(w)``) bypasses the version counter and is not seen: load weights
        with ``param.copy_(w)`` under ``torch.no_grad()``, or assign ``param.data``."""
        return source is self.source and (source._version, source.data_ptr()) == self.stamp

    def gelu_fusable(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """``gelu(self(x, bias=bias))`` can run as one kernel call (``linear_gelu``)."""
        return (self.mode == "panel" and not self.silu_mul and x.dtype == torch.float32
                and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1 and bias.is_contiguous())))

    def linear_gelu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``gelu(x @ W.T + bias)`` (the erf form) with the GELU computed in the kernel's store
        (``gelu_fusable`` must hold): within float32 rounding of PyTorch's GELU, not its bits."""
        shape = x.shape
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, shape[-1]).contiguous()
        y = self._kernel.linear(x, self.packed, self.n_out, False, None, bias, True)
        return y.view(*shape[:-1], y.shape[-1]) if len(shape) != 2 else y

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``torch.argmax(self(x), -1)`` without storing the product (``linear_argmax``), for float32
        x over a float32 panel weight without silu_mul; None otherwise."""
        if (self.mode != "panel" or self.silu_mul or x.dtype != torch.float32 or self.packed.dim() != 3
                or self._kernel is None):
            return None
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return self._kernel.linear_argmax(rows, self.packed, self.n_out).view(x.shape[:-1])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T``, then ``+= bias`` (in place, as ``y.add_(bias)``), then ``+ residual`` (a new
        tensor); on the panel route they are fused into the kernel's store where they can be (of x's
        dtype, contiguous), with the same result (a residual without a bias: added to the product
        before it is stored)."""
        shape = x.shape
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, shape[-1]).contiguous()
        if self.mode == "panel":  # the output has x's dtype
            fuse = residual is not None and residual.dtype == x.dtype and residual.is_contiguous()
            fuse_bias = (bias is not None and not self.silu_mul and bias.dtype == x.dtype and bias.dim() == 1
                         and bias.is_contiguous() and bias.device.type == "cpu" and (residual is None or fuse))
            if bias is not None and not fuse_bias:
                fuse = False  # the bias goes first, after the store: so does the residual then
            y = self._kernel.linear(x, self.packed, self.n_out, self.silu_mul,
                                    residual.reshape(-1, self.n_out) if fuse else None, bias if fuse_bias else None)
            if bias is not None and not fuse_bias:
                y.add_(bias)
            if residual is not None and not fuse:
                y = y + residual.reshape(y.shape)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
            if self.silu_mul:
                n = y.shape[-1] // 2
                y = F.silu(y[:, :n]) * y[:, n:]
            if bias is not None:
                y.add_(bias)
            if residual is not None:
                y = y + residual.reshape(y.shape)
        return y.view(*shape[:-1], y.shape[-1]) if len(shape) != 2 else y


Snapshot = tuple[tuple[torch.Tensor, int, int], ...]


def versions(*tensors: torch.Tensor) -> Snapshot:
    """What ``unchanged`` compares against: each tensor with its version counter and storage now."""
    return tuple((t, t._version, t.data_ptr()) for t in tensors)


def unchanged(snapshot: Snapshot, *tensors: torch.Tensor) -> bool:
    """``tensors`` are the very tensors of ``snapshot`` (``versions``), none written since in place
    nor given new storage (``PrepackedLinear.fresh`` says which writes go unseen)."""
    return len(snapshot) == len(tensors) and all(t is s and t._version == v and t.data_ptr() == d
                                                  for t, (s, v, d) in zip(tensors, snapshot))


def hooked(*modules: nn.Module) -> bool:
    """Some of ``modules`` has forward hooks (a path that calls kernels directly must not skip them)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class PrepackableLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict names) whose ``prepack()`` switches it to a
    prepacked copy of its weight, the bias added in the kernel's store (the same bits as adding it
    after). For families whose projections are plain linears (Qwen3-Omni, V-JEPA 2-AC), where the panel
    kernel beats ``F.linear`` on their shapes (a wide vocabulary head included; figures in BENCHMARKS.md).
    Inputs of another dtype or device than the weight, or a weight changed since it was packed,
    take ``nn.Linear``'s path."""

    prepacked: PrepackedLinear | None = None

    def prepack(self) -> bool:
        if not can_prepack(self.weight) or (self.bias is not None and self.bias.dtype != self.weight.dtype):
            return False
        self.prepacked = PrepackedLinear(self.weight)
        return True

    def _usable(self, x: torch.Tensor) -> PrepackedLinear | None:
        pre = self.prepacked
        if pre is not None and x.dtype == self.weight.dtype and x.device.type == "cpu" and pre.fresh(self.weight):
            return pre
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self._usable(x)
        if pre is not None:
            return pre(x, bias=self.bias)  # the bias added in the kernel's store where it can be
        return super().forward(x)

    def row_invariant(self, x: torch.Tensor) -> bool:
        """``self(x)`` takes the panel kernel: each row of the result is the same bits in any batch
        (the plain and oneDNN paths may round a row differently with the number of rows)."""
        pre = self._usable(x)
        return pre is not None and pre.mode == "panel"

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``torch.argmax(self(x), -1)`` for a bias-free float32 panel weight, computed without storing
        the product (``linear_argmax``: each row's maximum kept as the kernel goes; the values are the
        ones ``self(x)`` stores, so the same indices); None where that path does not apply (the caller
        takes the logits). Not with hooks: they would expect to see the output."""
        pre = None if hooked(self) or self.bias is not None else self._usable(x)
        return None if pre is None else pre.argmax(x)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``F.gelu(self(x))``; on the prepacked float32 path the GELU is computed in the kernel's
        store (within float32 rounding of ``F.gelu``, not its bits). Runs the module (and its
        hooks) when it has hooks."""
        pre = None if hooked(self) else self._usable(x)
        if pre is not None and pre.gelu_fusable(x, self.bias):
            return pre.linear_gelu(x, self.bias)
        return F.gelu(self(x))

    def forward_plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, the bias and the residual added in the kernel's store where the
        prepacked weight is used (the same bits). Runs the module (and its hooks) when it has hooks."""
        pre = None if hooked(self) else self._usable(x)
        if pre is not None:
            return pre(x, residual, bias=self.bias)
        return residual + self(x)


class PrepackedGroup:
    """Several bias-free ``nn.Linear`` s over the same input as ONE prepacked multiply, their outputs
    side by side (q/k/v), or ``silu_mul=True``: a (gate, up) pair returning ``silu(gate) * up``.
    Valid while each linear still holds the very weight it was packed from, unchanged
    (``fresh()``); callers take their plain path otherwise."""

    def __init__(self, linears: list[nn.Linear], *, silu_mul: bool = False) -> None:
        if any(lin.bias is not None for lin in linears):
            raise ValueError("PrepackedGroup packs bias-free linears only")
        self.linears = list(linears)
        self.weights = versions(*(lin.weight for lin in linears))
        with torch.no_grad():
            self.linear = PrepackedLinear(torch.cat([lin.weight.detach() for lin in linears]), silu_mul=silu_mul)

    @staticmethod
    def build(linears: list[nn.Linear], *, silu_mul: bool = False) -> PrepackedGroup | None:
        """The group, or None when the weights cannot be prepacked here (``can_prepack``)."""
        if not can_prepack(*(lin.weight for lin in linears)) or any(lin.bias is not None for lin in linears):
            return None
        return PrepackedGroup(linears, silu_mul=silu_mul)

    def fresh(self) -> bool:
        return unchanged(self.weights, *(lin.weight for lin in self.linears))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x, residual)


def can_prepack(*weights: torch.Tensor | None) -> bool:
    """Every weight is a CPU tensor of a dtype the current route multiplies (panel: float32 or
    bfloat16; oneDNN: float32)."""
    dtypes = (torch.float32, torch.bfloat16) if _route() == "panel" else (torch.float32,)
    return all(w is not None and w.dtype in dtypes and w.device.type == "cpu" for w in weights)


def prepack_linears(module: nn.Module) -> int:
    """Prepack the projections of every submodule of ``module`` that has a ``prepack()`` method,
    on the route ``prepack_mode(True)`` names; returns how many did (0 when no route can run here:
    the plain path is kept)."""
    if prepack_mode(True) is None:
        return 0
    count = 0
    try:
        for sub in module.modules():
            prepack = getattr(sub, "prepack", None)
            if callable(prepack) and prepack():
                count += 1
    except RuntimeError as exc:  # a build that cannot pack these shapes: keep the plain path
        log.warning("prepacked linears unavailable, using plain matrix multiplies (%s)", exc)
        for sub in module.modules():
            if hasattr(sub, "prepacked"):
                sub.prepacked = None
        return 0
    return count


def held_weight_bytes(*modules: nn.Module) -> int:
    """Bytes the modules' weights hold in memory, each storage once: their materialised parameters and
    buffers, and the packed copies their submodules compute with (``prepacked`` linears and groups,
    a quantized embedding's ``table``: anything with a ``packed`` tensor)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.device.type == "meta" or t.numel() == 0:
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            add(t)
        for sub in module.modules():
            pre = getattr(sub, "prepacked", None)
            for held in [*(pre if isinstance(pre, tuple | list) else (pre,)), getattr(sub, "table", None)]:
                held = getattr(held, "linear", held)  # a PrepackedGroup's one multiply
                packed = getattr(held, "packed", None)
                add(packed if isinstance(packed, torch.Tensor) else None)
                weight = getattr(held, "weight", None)  # a QuantizedLinear without the kernel: the file's blocks
                add(getattr(weight, "blocks", None))
    return total
