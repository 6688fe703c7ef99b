"""Tensor parallelism as a transform of a built model (``apply_tp``), in the spirit of gpt-fast.

``apply_tp(module, tp)`` replaces, in place, every building block it knows by this rank's shard:

* attention (``LlamaAttention``): q/k/v column-parallel, split per packed component by whole heads
  (rank r keeps q heads ``[r * Hq / tp, (r + 1) * Hq / tp)`` and the kv heads they read, so GQA
  groups never straddle ranks; with ``tp > Hkv`` each kv head is replicated on ``tp / Hkv`` ranks);
  o row-parallel, its output summed over the group (an all-reduce per layer);
* MLP (``LlamaMLP``): gate/up column-parallel, down row-parallel, output all-reduced;
* any other block with a ``shard_tp(tp)`` method shards itself (BAGEL's MoT attention, with its
  two weight sets, q/k/v biases and per-head q/k norms) with ``column_shard`` / ``row_shard``;
* token embeddings (an ``embed_tokens`` ``nn.Embedding`` anywhere in the node): vocab-parallel, the vocabulary padded
  to a multiple of ``tp`` (rows past the vocabulary are zero and never looked up); ids outside a
  rank's rows give zeros there, and the all-reduce assembles the embedding;
* the LM head (an ``lm_head`` ``nn.Linear`` anywhere in the node): vocab-parallel, sharing the embedding's shard when the two
  are tied; logits are all-gathered, so every rank holds the full row (the padding cut off). A node
  whose ``vocab_parallel_head`` is False (it reads head rows itself, e.g. Orpheus's constrained
  audio sampling) keeps a full replica of the head instead;
* the node's ``kv_spec``: the paged KV cache holds this rank's kv heads only.

Row-parallel sums happen in forward hooks on the attention / MLP blocks, so the packed and
prepacked paths of ``mstar.layers.llama`` are used unchanged on the shards (with the residual
added after the reduction: ``takes_residual = False``). With two ranks
gloo's sum is the same on both (``a + b``), so every rank's residual stream stays bitwise equal
and the leader's results do not depend on which rank computed what.

There are no mixture-of-experts layers in any family yet, so there is no expert sharding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.llama import LlamaAttention, LlamaMLP

__all__ = ["TPGroup", "TPPeerLost", "VocabParallelEmbedding", "VocabParallelHead", "apply_tp", "column_shard",
           "head_shard", "row_shard", "shardable"]


class TPPeerLost(ConnectionError):
    """A collective of a tensor-parallel group failed: a rank of the group is gone (or stuck past
    the group's timeout). The group cannot be used again."""


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group and the collectives over it.

    ``group`` is a ``torch.distributed`` process group (None: the default group).
    """

    rank: int
    size: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:
            raise TPPeerLost(f"all-reduce over tensor-parallel rank {self.rank} of {self.size} failed: {e}") from e
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension, in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x, group=self.group)
        except RuntimeError as e:
            raise TPPeerLost(f"all-gather over tensor-parallel rank {self.rank} of {self.size} failed: {e}") from e
        return torch.cat(parts, dim=-1)

    def reduce_output(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        """Forward hook of a row-parallel block: sum the partial outputs in place."""
        self.all_reduce(output)


@dataclass(frozen=True)
class HeadShard:
    """The heads a rank keeps: q heads ``[q0, q0 + nq)`` and kv heads ``[kv0, kv0 + nkv)``."""

    q0: int
    nq: int
    kv0: int
    nkv: int


def head_shard(num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadShard:
    """Whole heads per rank, each rank's q heads with the kv heads they attend through."""
    if num_heads % tp.size:
        raise ValueError(f"tensor parallelism over {tp.size} ranks needs the attention heads "
                         f"({num_heads}) to be a multiple of tp_size")
    nq = num_heads // tp.size
    if num_kv_heads % tp.size == 0:
        nkv = num_kv_heads // tp.size
        return HeadShard(tp.rank * nq, nq, tp.rank * nkv, nkv)
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor parallelism over {tp.size} ranks needs the kv heads ({num_kv_heads}) "
                         f"to divide tp_size or be a multiple of it")
    return HeadShard(tp.rank * nq, nq, tp.rank // (tp.size // num_kv_heads), 1)  # replicated kv heads


def _linear_like(src: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                    device=weight.device)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    out.weight.requires_grad_(src.weight.requires_grad)
    return out


def column_shard(lin: nn.Linear, start: int, n: int) -> nn.Linear:
    """Column-parallel shard: output features ``[start, start + n)``."""
    bias = None if lin.bias is None else lin.bias.detach()[start:start + n]
    return _linear_like(lin, lin.weight.detach()[start:start + n], bias)


def row_shard(lin: nn.Linear, start: int, n: int, tp: TPGroup) -> nn.Linear:
    """Row-parallel shard: input features ``[start, start + n)``; only rank 0 adds the bias."""
    bias = None if lin.bias is None else (lin.bias.detach() if tp.rank == 0 else torch.zeros_like(lin.bias))
    return _linear_like(lin, lin.weight.detach()[:, start:start + n], bias)


def shard_attention(attn: LlamaAttention, tp: TPGroup) -> None:
    s, d = head_shard(attn.num_heads, attn.num_kv_heads, tp), attn.head_dim
    attn.set_projections(column_shard(attn.q_proj, s.q0 * d, s.nq * d), column_shard(attn.k_proj, s.kv0 * d, s.nkv * d),
                         column_shard(attn.v_proj, s.kv0 * d, s.nkv * d), row_shard(attn.o_proj, s.q0 * d, s.nq * d, tp))
    attn.takes_residual = False  # the residual is added after the all-reduce, not once per rank
    attn.register_forward_hook(tp.reduce_output)


def shard_mlp(mlp: LlamaMLP, tp: TPGroup) -> None:
    inter = mlp.gate_proj.out_features
    if inter % tp.size:
        raise ValueError(f"tensor parallelism over {tp.size} ranks needs the MLP width ({inter}) to be a "
                         f"multiple of tp_size")
    n = inter // tp.size
    lo = tp.rank * n
    mlp.set_projections(column_shard(mlp.gate_proj, lo, n), column_shard(mlp.up_proj, lo, n), row_shard(mlp.down_proj, lo, n, tp))
    mlp.takes_residual = False
    mlp.register_forward_hook(tp.reduce_output)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of an embedding (zero rows past the vocabulary)."""

    def __init__(self, full: torch.Tensor, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size = full.shape[0]
        self.rows = -(-self.vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.tp = tp
        shard = torch.zeros((self.rows, full.shape[1]), dtype=full.dtype, device=full.device)
        mine = full.detach()[self.start:self.start + self.rows]
        shard[:mine.shape[0]] = mine
        self.weight = nn.Parameter(shard, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.rows}) of {self.vocab_size}, tp={self.tp.size}"


class VocabParallelHead(nn.Module):
    """An LM head over a vocab-parallel weight: local logits, all-gathered, padding cut off."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., :self.vocab_size]


def _shard_embeddings(module: nn.Module, tp: TPGroup) -> dict[int, tuple[torch.Tensor, VocabParallelEmbedding]]:
    """Every ``embed_tokens`` embedding, vocab-parallel: original weight id -> (that weight, its shard)."""
    out = {}
    for owner in list(module.modules()):
        emb = getattr(owner, "embed_tokens", None)
        if isinstance(emb, nn.Embedding):
            owner.embed_tokens = VocabParallelEmbedding(emb.weight, tp)
            out[id(emb.weight)] = (emb.weight, owner.embed_tokens)
    return out


def _shard_heads(module: nn.Module, embeddings: dict[int, tuple[torch.Tensor, VocabParallelEmbedding]],
                 tp: TPGroup) -> None:
    """Every ``lm_head``: vocab-parallel (tied: the embedding's shard), or a whole replica when the
    node's ``vocab_parallel_head`` is False."""
    parallel = getattr(module, "vocab_parallel_head", True)
    for owner in list(module.modules()):
        head = getattr(owner, "lm_head", None)
        if not isinstance(head, nn.Linear):
            continue
        if not parallel:  # a replica: untied from the (now sharded) embedding
            owner.lm_head = _linear_like(head, head.weight.detach().clone(), head.bias)
            continue
        tied = embeddings.get(id(head.weight))
        weight = tied[1].weight if tied is not None else VocabParallelEmbedding(head.weight, tp).weight
        owner.lm_head = VocabParallelHead(weight, head.out_features, tp)
    if parallel and hasattr(module, "prepacked"):
        module.prepacked = None  # a prepacked full head would bypass the shard


def shardable(module: nn.Module) -> bool:
    """Whether ``apply_tp`` has anything to shard in ``module`` (else it runs whole, on one rank)."""
    return any(isinstance(m, LlamaAttention | LlamaMLP) or callable(getattr(m, "shard_tp", None))
               for m in module.modules())


def apply_tp(module: nn.Module, tp: TPGroup) -> nn.Module:
    """Shard ``module`` (a built node, weights loaded) for rank ``tp.rank`` of ``tp.size``; in place.

    Raises ValueError when the module has no layer this transform knows, or when a shape does not
    split over ``tp.size`` ranks (heads, MLP width).
    """
    if tp.size == 1:
        return module
    blocks = list(module.modules())
    attns = [m for m in blocks if isinstance(m, LlamaAttention)]
    own = [m for m in blocks if callable(getattr(m, "shard_tp", None))]
    mlps = [m for m in blocks if isinstance(m, LlamaMLP)]
    if not shardable(module):
        raise ValueError(f"{type(module).__name__} has no layer that tensor parallelism can shard "
                         f"(Llama attention / MLP blocks, or a block with shard_tp)")
    if any(getattr(m, "stored", False) for m in [*attns, *mlps]):
        raise ValueError("tensor parallelism needs dequantized weights: serve this GGUF file with "
                         "--no-weights-as-stored (its projections are kept quantized as stored)")
    shards = {head_shard(a.num_heads, a.num_kv_heads, tp) for a in [*attns, *own]
              if hasattr(a, "num_kv_heads")}  # checks every layer before changing any
    for a in attns:
        shard_attention(a, tp)
    for m in own:
        m.shard_tp(tp)
    for m in mlps:
        shard_mlp(m, tp)
    _shard_heads(module, _shard_embeddings(module, tp), tp)
    spec = getattr(module, "kv_spec", None)
    if spec is not None and shards:
        (shard,) = shards
        module.kv_spec = dataclasses.replace(spec, num_kv_heads=shard.nkv)
    return module
