"""Token sampling for autoregressive decoding.

The central entry point is :func:`sample`, which turns a batch of next-token logits ``[B, V]`` into one
token id per row.  Processing follows the order vLLM uses:

1. ``logit_bias`` (added to the listed tokens' logits),
2. repetition penalty (HF semantics, over prompt + generated tokens),
3. presence and frequency penalties (OpenAI semantics, over the generated tokens only),
4. temperature,
5. top-k,
6. top-p (nucleus),

followed by either an argmax (``temperature == 0``) or a random draw. The filters live in
:mod:`mstar.layers.logit_filters` (re-exported here). A row asking for ``logprobs`` gets the log-softmax
of its logits after steps 1-3 (biased and penalised, before temperature and top-k / top-p): the
distribution the request's own choices shaped, independent of how it is then sampled.

Batch invariance
----------------
For a request with a ``seed`` the sampled token depends only on that row's logits, its
:class:`SamplingParams`, its seen tokens and its step index -- never on the other rows, the batch size or
the row's position.  This holds because

* every transformation above is row-wise (element-wise ops, per-row sort / softmax / cumsum),
* the random draw is an inverse-CDF draw over the tokens the filters kept: the softmax of the row's
  kept logits is accumulated in vocabulary order (the running sum in float64) and the token is the
  first whose cumulative weight exceeds ``U`` times the total, which selects token ``j`` with probability
  ``softmax(scaled_logits)[j]``, and
* the one uniform ``U`` of a row is drawn from a fresh :class:`torch.Generator` seeded from
  ``(seed, step_index)`` alone (one number per row and step: a Gumbel race over the vocabulary
  needs one per token, a whole vocabulary's worth of random numbers for every row and step).

Rows without a seed draw from a process-wide generator (non-deterministic across processes).
Seeded results are reproducible for a given device type; CPU and accelerator generators produce different
streams.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.layers.cpu_ops import ops
from mstar.layers.logit_filters import (
    apply_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k_top_p,
)
from mstar.layers.sampling_params import (
    EXTENDED_FIELDS,
    MAX_LOGPROBS,
    SamplingParams,
    is_int,
    request_sampling,
)

__all__ = [
    "EXTENDED_FIELDS",
    "MAX_LOGPROBS",
    "RowLogprobs",
    "SamplingParams",
    "apply_logit_bias",
    "apply_presence_frequency",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k_top_p",
    "request_sampling",
    "row_seed",
    "sample",
    "sample_with_logprobs",
]

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


# --------------------------------------------------------------------------------------------------------
# Randomness
# --------------------------------------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    """The SplitMix64 finaliser: a bijection on 64-bit integers with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int) -> int:
    """Deterministic 63-bit generator seed for request ``seed`` at sampling step ``step``.

    Distinct steps of the same seed map to distinct 64-bit values before the final 63-bit mask.
    """
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64) & _MASK63


_shared_lock = threading.Lock()
_shared_generators: dict[str, torch.Generator] = {}


def _new_generator(device: torch.device) -> torch.Generator:
    try:
        return torch.Generator(device=device)
    except RuntimeError:  # device type without its own generator: fall back to CPU
        return torch.Generator(device="cpu")


def _shared_generator(device: torch.device) -> torch.Generator:
    key = str(device)
    gen = _shared_generators.get(key)
    if gen is None:
        gen = _new_generator(device)
        gen.manual_seed(secrets.randbits(63))
        _shared_generators[key] = gen
    return gen


def _uniform(device: torch.device, seed: int | None, step: int) -> float:
    """One float64 ``U ~ U[0, 1)`` for a row: from a generator seeded with ``(seed, step)``, or the
    process-wide one for an unseeded row."""
    if seed is None:
        with _shared_lock:
            gen = _shared_generator(device)
            return float(torch.rand(1, dtype=torch.float64, device=gen.device, generator=gen))
    gen = _new_generator(device)
    gen.manual_seed(row_seed(seed, step))
    return float(torch.rand(1, dtype=torch.float64, device=gen.device, generator=gen))


def _draw(vals: torch.Tensor, u: float) -> int:
    """The index ``j`` of the finite logits ``vals`` [n] whose cumulative softmax weight (summed in
    float64, in vocabulary order) first exceeds ``u`` times the total: index j with probability
    ``softmax(vals)[j]``; a weight that underflows to 0 is never drawn."""
    cdf = torch.cumsum(torch.softmax(vals.detach(), dim=-1), dim=-1, dtype=torch.float64)
    target = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=vals.device)
    return min(int(torch.searchsorted(cdf, target, right=True)), vals.numel() - 1)


# --------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16)


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of float32 or bfloat16 logits ``[B, V]``: through the compiled
    kernel on CPU (rows in parallel, one pass; torch's CPU argmax runs a batch on one thread, and
    bfloat16 rows go through a widening copy first), else torch's. A bfloat16 row's argmax is that of its float32
    values (the widening is exact)."""
    ext = ops() if x.device.type == "cpu" and x.dtype in _ARGMAX_DTYPES and x.dim() == 2 else None
    if ext is None or x.shape[1] == 0:
        return torch.argmax(x, dim=-1)
    return ext.argmax_rows(x.contiguous())


@dataclass(frozen=True)
class RowLogprobs:
    """One row's log probabilities: ``ids`` int64 ``[1 + k]`` (the sampled token, then the ``k`` most
    likely tokens in descending order) and ``logprobs`` float32 ``[1 + k]``, theirs."""

    ids: torch.Tensor
    logprobs: torch.Tensor


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seen_tokens: Sequence[Sequence[int] | torch.Tensor | None] | None,
    step_indices: list[int],
) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` next-token logits, any floating dtype (computed in float32).
        params: one :class:`SamplingParams` per row.
        seen_tokens: per row, the token ids seen so far (prompt + generated) for the penalties, as a
            sequence of ids or a 1-D integer tensor (a row's None: none); ``None`` means none for every
            row. The last ``step_indices[i]`` of a row are its generated tokens.
        step_indices: per row, how many tokens that request has sampled so far (0 for the first).

    Returns:
        int64 tensor ``[B]`` on ``logits.device``.  For seeded rows the result depends only on that row's
        inputs (see the module docstring); greedy rows are the argmax of the biased, penalised logits.
    """
    return sample_with_logprobs(logits, params, seen_tokens, step_indices)[0]


def _check_batch(logits: torch.Tensor, params: list[SamplingParams], seen_tokens: Sequence | None,
                 step_indices: list[int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for a batch of {batch}")
    if len(step_indices) != batch:
        raise ValueError(f"got {len(step_indices)} step indices for a batch of {batch}")
    if seen_tokens is not None and len(seen_tokens) != batch:
        raise ValueError(f"got {len(seen_tokens)} seen_tokens entries for a batch of {batch}")
    for s in step_indices:
        if not is_int(s) or s < 0:
            raise ValueError(f"step indices must be ints >= 0, got {s!r}")
    if batch and vocab == 0:
        raise ValueError("logits have an empty vocabulary dimension")


def _processed(logits: torch.Tensor, params: list[SamplingParams],
               seen_tokens: Sequence[Sequence[int] | torch.Tensor | None] | None,
               step_indices: list[int]) -> torch.Tensor | None:
    """The float32 logits after the bias and the penalties, or None when no row asks for any (the
    logits are then used as they are, without a copy)."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalised = any(p.repetition_penalty != 1.0 for p in params)
    pf = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not (biased or penalised or pf):
        return None
    x = logits.to(torch.float32, copy=True)
    if biased:
        apply_logit_bias(x, biased, [params[i].bias_tensors for i in biased])
    if penalised:
        x = apply_repetition_penalty(x, seen_tokens, [p.repetition_penalty for p in params])
    if pf:
        generated = []
        for i in pf:
            seen, n = None if seen_tokens is None else seen_tokens[i], step_indices[i]
            ids = _seen_tensor(seen)
            generated.append(ids[ids.numel() - min(n, ids.numel()):] if n else ids[:0])
        apply_presence_frequency(x, pf, generated, [params[i].presence_penalty for i in pf],
                                 [params[i].frequency_penalty for i in pf])
    return x


def _seen_tensor(seen: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
    if seen is None:
        return torch.zeros(0, dtype=torch.long)
    if isinstance(seen, torch.Tensor):
        return seen.reshape(-1).to(device="cpu", dtype=torch.long)
    return torch.tensor(list(seen), dtype=torch.long)


def _row_logprobs(x: torch.Tensor, rows: list[int], tokens: torch.Tensor,
                  params: list[SamplingParams]) -> list[RowLogprobs | None]:
    """``RowLogprobs`` of ``rows`` of the processed logits ``x`` (None for the other rows)."""
    out: list[RowLogprobs | None] = [None] * x.shape[0]
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    lp = torch.log_softmax(x[idx].to(torch.float32), dim=-1)
    most = max(params[i].logprobs for i in rows)
    if most:
        top_vals, top_ids = torch.topk(lp, min(most, lp.shape[1]), dim=-1)
    else:
        top_vals, top_ids = lp[:, :0], torch.zeros((len(rows), 0), dtype=torch.long, device=x.device)
    chosen = tokens[idx].to(x.device)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0]
    for r, i in enumerate(rows):
        k = params[i].logprobs
        out[i] = RowLogprobs(torch.cat([chosen[r:r + 1], top_ids[r, :k]]).cpu(),
                             torch.cat([chosen_lp[r:r + 1], top_vals[r, :k]]).cpu())
    return out


def sample_with_logprobs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seen_tokens: Sequence[Sequence[int] | torch.Tensor | None] | None,
    step_indices: list[int],
) -> tuple[torch.Tensor, list[RowLogprobs | None]]:
    """``sample``, and per row its ``RowLogprobs`` when its params ask for ``logprobs`` (else None):
    the log-softmax of the row's biased and penalised logits, before temperature and top-k / top-p."""
    _check_batch(logits, params, seen_tokens, step_indices)
    batch = logits.shape[0]
    device = logits.device
    if batch == 0:
        return torch.empty(0, dtype=torch.long, device=device), []
    x = _processed(logits, params, seen_tokens, step_indices)
    tokens = _sample_processed(logits if x is None else x, x is not None, params, step_indices)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return tokens, [None] * batch
    return tokens, _row_logprobs(logits if x is None else x, rows, tokens, params)


def _sample_processed(x: torch.Tensor, is_float32_copy: bool, params: list[SamplingParams],
                      step_indices: list[int]) -> torch.Tensor:
    batch, vocab = x.shape
    device = x.device
    greedy = [p.greedy for p in params]
    if all(greedy):  # the argmax of the logits as they are (no float32 copy)
        return _argmax_rows(x)
    if not is_float32_copy:
        x = x.to(torch.float32)
    out = torch.empty(batch, dtype=torch.long, device=device)
    g_rows = [i for i, g in enumerate(greedy) if g]
    s_rows = [i for i, g in enumerate(greedy) if not g]

    if g_rows:
        # top-k / top-p never remove the maximum, so greedy is argmax of the penalised logits.
        gi = torch.tensor(g_rows, dtype=torch.long, device=device)
        out[gi] = _argmax_rows(x[gi])

    if s_rows:
        si = torch.tensor(s_rows, dtype=torch.long, device=device)
        sp = [params[i] for i in s_rows]
        xs = apply_temperature(x[si], [p.temperature for p in sp])
        xs = apply_top_k_top_p(xs, [p.top_k for p in sp], [p.top_p for p in sp])
        finite = torch.isfinite(xs)
        counts = finite.sum(dim=-1).tolist()
        for row, (i, p) in enumerate(zip(s_rows, sp)):
            # one draw over the tokens the filters kept (in vocabulary order): cheap when top-k /
            # top-p keep a few tokens, one softmax + cumsum of the row when they keep all
            u = _uniform(device, p.seed, step_indices[i])
            if counts[row] == vocab:
                out[i] = _draw(xs[row], u)
            elif counts[row]:
                kept = finite[row].nonzero().squeeze(-1)
                out[i] = kept[_draw(xs[row, kept], u)]
            else:  # every logit masked: the first token, as an argmax of the row would give
                out[i] = 0
    return out
