"""The compute side of a node: ``NodeSubmodule`` and what flows in and out of it.

The runtime calls, for every request in a batch, ``prepare_inputs`` (per request, cheap, may look
at the request's parameters and iteration), then ONE ``forward`` over the whole batch. ``forward``
receives each named tensor concatenated along dim 0 over the batch (``EngineInputs.splits`` gives
each request's rows) and returns, for every output name, one tensor per request in batch order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.layers.paged_attention import QueryMode


@dataclass(slots=True)
class ForwardInfo:
    """What a node knows about one request when preparing its inputs (read-only by convention; not
    frozen because a frozen dataclass's ``__init__`` goes through ``object.__setattr__`` per field,
    and one is built per request per step)."""

    request_id: str
    walk: str
    node: str
    iteration: tuple[int, ...]  # index in each enclosing loop, outermost first; () at top level
    params: Any  # the request's params as the model parsed them (``ModelDef.parse_request``; read-only)
    cache_len: int = 0  # tokens already in this node's cache for the request (KV nodes)
    stream_chunks: Mapping[str, Any] = field(default_factory=dict)  # stream input -> chunk position info


@dataclass(slots=True)
class KVSequence:
    """One of several cache sequences a request brings to a KV node's forward (e.g. the samples of a
    planner, each rolling out in its own cache forked from a shared context)."""

    cache_name: str
    num_tokens: int
    mode: QueryMode = QueryMode.CAUSAL_APPEND
    fork_from: tuple[str, int | None] | None = None
    refork: bool = False  # drop an existing cache of this name first, then fork it again


@dataclass(slots=True)
class NodeInputs:
    """One request's contribution to a batched forward.

    ``tensor_inputs``: tensors concatenated over the batch along dim 0 (give each request's rows
    on dim 0). ``args``: the request's other values for the forward, one object (the node's own
    typed record, e.g. the LLM's sampling, step and seen tokens; or a single value), handed to
    ``forward`` in ``EngineInputs.args``, one per request.
    KV nodes also say how many new tokens they bring (``num_tokens``, = rows of the token
    tensors), how they attend (``mode``), which cache they use (``cache_name``; default: the
    node's own) and optionally ``fork_from=(cache_name, num_tokens)``: before this forward, create
    the cache as a copy-on-write fork sharing the first ``num_tokens`` tokens of another cache of
    the same request (None = all of them). ``sequences`` replaces all of that with several cache
    sequences, in order (their tokens are the request's rows, sequence after sequence).
    """

    tensor_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    args: Any = None
    num_tokens: int = 0
    mode: QueryMode = QueryMode.CAUSAL_APPEND
    cache_name: str | None = None
    fork_from: tuple[str, int | None] | None = None
    sequences: list[KVSequence] | None = None  # several sequences instead of the single one above
    prefix_ids: torch.Tensor | None = None  # int64 [<= num_tokens]: leading tokens that may reuse cached blocks
    token_inputs: tuple[str, ...] = ()  # tensor inputs with one row per new token (trimmed on reuse)


@dataclass(slots=True)
class EngineInputs:
    """Batch-level inputs the engine builds; passed explicitly to ``forward`` (no globals)."""

    walks: list[str]  # per request
    nodes: list[str]  # per request (several names when weight-sharing views batch together)
    request_ids: list[str]
    infos: list[ForwardInfo]
    splits: dict[str, list[int]]  # per tensor name: rows contributed by each request
    args: list[Any]  # per request: its ``NodeInputs.args``
    # KV nodes only:
    attention: Any = None  # mstar.layers.paged_attention.AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k_cache, v_cache)
    positions: torch.Tensor | None = None  # int64 [total_tokens]: absolute position of each new token
    num_tokens: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def split(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split a batched tensor back into per-request pieces along dim 0, using ``name``'s rows."""
        return list(torch.split(tensor, self.splits[name], dim=0))

    def token_splits(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split a [total_tokens, ...] tensor of a KV node into per-request pieces."""
        return list(torch.split(tensor, self.num_tokens, dim=0))

    def last_token_rows(self) -> torch.Tensor:
        """Index of each request's last new token in the flattened token batch."""
        counts = torch.tensor(self.num_tokens, dtype=torch.long)
        return torch.cumsum(counts, 0) - 1


@dataclass(frozen=True)
class KVSpec:
    """Shape of a node's paged KV cache. All views of one module share a KVSpec."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVSpec.{name} must be >= 1")


class NodeSubmodule(torch.nn.Module):
    """Base class of every node's computation.

    Subclasses set ``kv_spec`` (a ``KVSpec``) when the node attends over a KV cache the runtime
    owns; stateless nodes leave it None.
    """

    kv_spec: KVSpec | None = None

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        """Turn one request's edge values into its share of the batch.

        May run more than once for one node instance (an item that waited for KV blocks is
        prepared again), so it must have no side effects. Default: each input's first tensor,
        unchanged.
        """
        return NodeInputs(tensor_inputs={name: values[0] for name, values in inputs.items()})

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs,
                **tensors: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        raise NotImplementedError

    def continue_batch(self, graph_walk: str | None, engine_inputs: EngineInputs, tensors: Mapping[str, torch.Tensor],
                       outputs: Mapping[str, list[Any]]) -> tuple[dict[str, torch.Tensor], list[Any]] | None:
        """Optional, for the node of a self-loop that feeds itself (an AR decode step): the batch of
        the loop's next iteration, from this forward's batch (``engine_inputs``, ``tensors``) and its
        ``outputs``, for EVERY row, as if each row's fed-back outputs had gone through
        ``prepare_inputs``: ``(tensors, args)``, each tensor one row per request, ``args`` one per
        request. The runtime keeps
        the rows that go on (a KV node's rows of one decode token each) and skips ``prepare_inputs``
        for them. None (the default, or whenever the shortcut does not hold): the runtime prepares
        every row. The next forward of the same rows may get this forward's ``EngineInputs`` object
        again, brought up to date (``args``, ``attention``, ``positions``): read it during the
        forward and here, do not keep it."""
        return None

    def release(self, request_id: str) -> None:
        """Drop what this node keeps for a request between its forwards (a streaming decoder's state):
        the runtime calls it on every rank when the request ends, fails or is aborted. Nodes that
        keep nothing (the default) need not override it."""
