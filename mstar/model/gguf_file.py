"""A GGUF file (llama.cpp's checkpoint format) read through the ``gguf`` package, for any family's loader.

``GGUFFile(path)`` opens the file once (memory-mapped: tensor data is read only when a tensor is
asked for) and exposes:

* ``metadata``: every key -> its value (ints, floats, bools, strings; arrays as Python lists);
* ``tensor_names``, ``shape(name)`` (in torch order, outermost dimension first, as the tensor will be
  once dequantized), ``type_name(name)`` (``"Q4_1"``, ``"F32"``...), ``nbytes(name)`` (in the file);
* ``tensor(name)``: the tensor dequantized to a float32 ``torch.Tensor``; ``raw(name)``: its bytes as
  stored (for weights kept quantized, ``mstar.layers.quant``).

Quantized tensors are dequantized with the ``gguf`` package's reference NumPy kernels; the types in
``SUPPORTED_TYPES`` are the ones whose dequantization mstar's tests check against transformers' GGUF
loader. Anything else is a ``CheckpointError`` naming the tensor and its type. ``open_gguf`` keeps the
last files opened in this process, so the config, tokenizer and weights of one model parse the
file's metadata once.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.model.checkpoint import CheckpointError, CheckpointNotFoundError

__all__ = ["SUPPORTED_TYPES", "GGUFFile", "is_gguf_path", "open_gguf"]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_CACHE_SIZE = 2
_cache: OrderedDict[tuple[str, int, int], GGUFFile] = OrderedDict()


def is_gguf_path(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix; the file need not exist)."""
    return path is not None and str(path).lower().endswith(".gguf")


def _gguf_module() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency of mstar
        raise ImportError("reading a .gguf checkpoint needs the 'gguf' package (pip install gguf)") from e
    return gguf


def _field_value(field: Any, gguf: Any) -> Any:
    """A metadata field as a Python value (arrays as lists)."""
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and not isinstance(value, list):
        return list(value)
    return value


class GGUFFile:
    """One GGUF file: metadata, tensor headers, and tensors dequantized on demand (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        gguf = _gguf_module()
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - name the file in the error
            raise CheckpointError(f"cannot read GGUF file {str(self.path)!r}: {e}") from e
        self._gguf = gguf
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):  # the header (version, counts), not model metadata
                continue
            self.metadata[key] = _field_value(field, gguf)
        self._tensors = {t.name: t for t in self._reader.tensors}

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r})"

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _info(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path.name}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in torch order (GGUF lists the innermost dimension first)."""
        return tuple(int(d) for d in reversed(self._info(name).shape.tolist()))

    def type_name(self, name: str) -> str:
        return self._info(name).tensor_type.name

    def nbytes(self, name: str) -> int:
        """The tensor's size in the file (quantized)."""
        return int(self._info(name).n_bytes)

    def unsupported_type(self, name: str) -> str | None:
        """Why the tensor cannot be loaded (its type, named), or None when it can."""
        kind = self.type_name(name)
        if kind in SUPPORTED_TYPES:
            return None
        return f"{name} has type {kind} (supported: {', '.join(SUPPORTED_TYPES)})"

    def release_pages(self) -> None:
        """Drop the file's pages read so far from this process's resident memory (after loading the
        weights): the mapping stays valid and pages are read again if touched; the metadata is parsed."""
        mapped = getattr(self._reader.data, "_mmap", None)  # numpy.memmap's mmap object
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mapped.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # advice only
                pass

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as stored in the file (a uint8 copy, not dequantized)."""
        data = np.asarray(self._info(name).data)
        return torch.from_numpy(np.array(data.reshape(-1).view(np.uint8), copy=True))

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, shaped ``shape(name)``."""
        info = self._info(name)
        problem = self.unsupported_type(name)
        if problem is not None:
            raise CheckpointError(f"{self.path.name}: tensor {problem}")
        try:
            values = self._gguf.quants.dequantize(info.data, info.tensor_type)
        except Exception as e:  # noqa: BLE001 - name the tensor in the error
            raise CheckpointError(f"{self.path.name}: cannot dequantize tensor {name} "
                                  f"({info.tensor_type.name}): {e}") from e
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:  # F32 data is a view of the read-only memory map
            values = values.copy()
        out = torch.from_numpy(values)
        shape = self.shape(name)
        if tuple(out.shape) != shape:
            out = out.reshape(shape)
        return out


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """A ``GGUFFile`` for ``path``, reused while the file is unchanged (the last two files opened)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise CheckpointNotFoundError(f"GGUF file {str(p)!r} does not exist") from None
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    f = GGUFFile(p)
    _cache[key] = f
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return f
