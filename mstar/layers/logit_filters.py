"""The logit filters of :mod:`mstar.layers.sampling`, in the order ``sample`` applies them: logit
bias, repetition penalty, presence / frequency penalties, temperature, top-k / top-p. All are
row-wise: a row's result never depends on the other rows of its batch. The bias and the presence /
frequency penalties change the float32 logits they are given in place; the others return new
float32 tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.layers.host_longs import long_tensor

__all__ = ["apply_logit_bias", "apply_presence_frequency", "apply_repetition_penalty", "apply_temperature",
           "apply_top_k_top_p"]


def _per_row(
    values: Sequence[float] | Sequence[int] | torch.Tensor,
    batch: int,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=dtype, device=device).reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"{name} has {t.numel()} entries for a batch of {batch}")
    return t


def _seen_ids(toks: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """One row's seen token ids as an int64 CPU tensor (a tensor as it is, a sequence through
    ``long_tensor``, which skips ``torch.tensor``'s per-element type inference)."""
    if isinstance(toks, torch.Tensor):
        return toks.reshape(-1).to(device="cpu", dtype=torch.int64)
    return long_tensor(map(int, toks))


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[int],
                     biases: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add each of ``rows``' ``(ids, biases)`` to its logits, in place (float32 ``[B, V]``). An id
    outside ``[0, V)`` raises ValueError (the model's request checks refuse one first)."""
    vocab = logits.shape[1]
    for i, (ids, b) in zip(rows, biases):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"logit_bias token id out of range [0, {vocab}) in row {i}")
        logits[i].index_add_(0, ids.to(logits.device), b.to(logits.device))


def apply_presence_frequency(logits: torch.Tensor, rows: Sequence[int], generated: Sequence[torch.Tensor],
                             presence: Sequence[float], frequency: Sequence[float]) -> None:
    """OpenAI's penalties, in place on float32 ``[B, V]`` logits: for each of ``rows``, every token
    of its ``generated`` ids (int64, the tokens it sampled so far) loses ``presence`` once and
    ``frequency`` times its count."""
    vocab = logits.shape[1]
    for i, ids, p, f in zip(rows, generated, presence, frequency):
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"generated token id out of range [0, {vocab}) in row {i}")
        tokens, counts = torch.unique(ids, return_counts=True)
        drop = counts.to(torch.float32) * f + p
        logits[i].index_add_(0, tokens.to(logits.device), -drop.to(logits.device))


def apply_repetition_penalty(
    logits: torch.Tensor,
    seen_tokens: Sequence[Sequence[int] | torch.Tensor | None] | None,
    penalties: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """HF repetition penalty, per row: for each distinct token in ``seen_tokens[i]`` (a sequence of
    ids or a 1-D integer tensor; None or empty: nothing), a logit ``> 0`` is divided by
    ``penalties[i]`` and any other logit multiplied by it.

    ``logits`` is ``[B, V]``; returns a new float32 tensor.  Token ids outside ``[0, V)`` raise ValueError.
    The rows' distinct (row, token) pairs are found in one pass over all of them (``torch.unique``),
    not a Python set per row: each pair's logit gets the same one multiply or divide either way.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    out = logits.to(torch.float32, copy=True)
    batch, vocab = out.shape
    pen = _per_row(penalties, batch, "penalties", torch.float32, torch.device("cpu"))
    if not bool((pen > 0).all()):
        raise ValueError("repetition penalties must be > 0")
    if seen_tokens is None:
        return out
    if len(seen_tokens) != batch:
        raise ValueError(f"seen_tokens has {len(seen_tokens)} entries for a batch of {batch}")
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for i, (p_i, toks) in enumerate(zip(pen.tolist(), seen_tokens)):  # Python floats: no tensor op a row
        if p_i == 1.0 or toks is None or len(toks) == 0:
            continue
        rows.append(i)
        parts.append(_seen_ids(toks))
    if not rows:
        return out
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        for i, ids in zip(rows, parts):  # the first row holding one, as the message names it
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"seen token id out of range [0, {vocab}) in row {i}: {lo if lo < 0 else hi}")
    base = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64) * vocab,
                                   torch.tensor([t.shape[0] for t in parts], dtype=torch.int64))
    at = torch.unique(base + flat)  # each row's distinct tokens once, as positions in the flat logits
    p = pen[torch.div(at, vocab, rounding_mode="floor")].to(out.device)
    at = at.to(out.device)
    flat_out = out.view(-1)
    vals = flat_out[at]
    flat_out[at] = torch.where(vals > 0, vals / p, vals * p)
    return out


def apply_temperature(logits: torch.Tensor, temperatures: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature; rows with temperature 0 (greedy) are left unchanged."""
    out = logits.to(torch.float32)
    temps = _per_row(temperatures, out.shape[0], "temperatures", torch.float32, out.device)
    temps = torch.where(temps > 0, temps, torch.ones_like(temps))
    return out / temps[:, None]


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: Sequence[int] | torch.Tensor,
    top_p: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Mask (set to ``-inf``) logits outside each row's top-k and then its nucleus (top-p).

    * top-k keeps every logit ``>=`` the k-th largest (ties kept, as in HF); ``k <= 0`` or ``k >= V``
      disables it.
    * top-p then keeps, in descending order, each token whose preceding probability mass (of the top-k
      filtered distribution) is ``< p``: the smallest prefix reaching mass ``p``; at least one token is
      always kept.  ``p >= 1`` disables it.

    ``logits`` is ``[B, V]``; returns a new float32 tensor.  A single descending sort serves both filters.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    out = logits.to(torch.float32, copy=True)
    batch, vocab = out.shape
    ks = _per_row(top_k, batch, "top_k", torch.long, out.device)
    ps = _per_row(top_p, batch, "top_p", torch.float32, out.device)
    use_k = (ks > 0) & (ks < vocab)
    use_p = ps < 1.0
    if batch == 0 or vocab == 0 or not bool((use_k | use_p).any()):
        return out

    finite = torch.isfinite(out)
    counts = finite.sum(dim=-1)
    if int(counts.max()) * 4 < vocab:
        return _top_k_top_p_compacted(out, finite, counts, ks, ps)
    fast = _top_k_top_p_partial(out, ks, ps, use_k, use_p)
    if fast is not None:
        return fast
    sorted_vals, sorted_idx = torch.sort(out, dim=-1, descending=True)
    # top-k: threshold at the k-th largest value (ties with it survive).
    kth = sorted_vals.gather(-1, (ks.clamp(1, vocab) - 1)[:, None])
    neg_inf = torch.tensor(float("-inf"), dtype=out.dtype, device=out.device)
    kth = torch.where(use_k[:, None], kth, neg_inf)
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    # top-p on the (already top-k filtered) distribution.
    probs = torch.softmax(sorted_vals, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_before >= ps[:, None]) & use_p[:, None]
    drop[:, 0] = False
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return out.scatter(-1, sorted_idx, sorted_vals)


def _top_k_top_p_compacted(out: torch.Tensor, finite: torch.Tensor, counts: torch.Tensor, ks: torch.Tensor,
                           ps: torch.Tensor) -> torch.Tensor:
    """The filters of rows whose logits are mostly masked already (constrained decoding: e.g. 4,097
    of 156,940 finite), run on their finite entries only: a [rows, n] problem instead of [rows, V].
    Rows are grouped by their number of finite entries, so that a row's sub-problem is exactly its
    own finite logits in vocabulary order, whatever the batch (no padding). Masked logits stay
    masked whatever k or p is (a k between n and V keeps all n, as on the full row)."""
    res = torch.full_like(out, float("-inf"))
    for n in torch.unique(counts).tolist():
        if n == 0:
            continue
        rows = (counts == n).nonzero().squeeze(-1)
        cols = finite[rows].nonzero()[:, 1].view(rows.numel(), n)  # row-major: ascending per row
        r = rows[:, None]
        res[r, cols] = apply_top_k_top_p(out[r, cols], ks[rows], ps[rows])
    return res


_PARTIAL_K = 256


def _top_k_top_p_partial(out: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, use_k: torch.Tensor,
                         use_p: torch.Tensor) -> torch.Tensor | None:
    """The same filtering from the ``_PARTIAL_K`` largest logits only, when that is provably exact
    for every row (its kept set lies inside them); None otherwise. A full sort of a large
    vocabulary orders every logit of the row; ``topk`` of 256 only finds the few a filter can keep.

    Exact when, per row: top-k is on with k < K and the k-th value is strictly above the K-th (no
    ties reach past K); or top-k is off and the K largest already hold probability mass >= p (so
    the nucleus ends inside them); or neither filter is on (the row is left unchanged).
    """
    batch, vocab = out.shape
    k_cap = min(_PARTIAL_K, vocab)
    if k_cap >= vocab:
        return None
    top_vals, top_idx = torch.topk(out, k_cap, dim=-1)  # sorted, descending
    kk = ks.clamp(1, k_cap)
    kth = top_vals.gather(-1, (kk - 1)[:, None])
    k_ok = use_k & (ks < k_cap) & (kth[:, 0] > top_vals[:, -1])
    full_lse = torch.logsumexp(out, dim=-1)
    p_ok = use_p & ~use_k & (torch.exp(torch.logsumexp(top_vals, dim=-1) - full_lse) >= ps)
    active = use_k | use_p
    if not bool((k_ok | p_ok | ~active).all()):
        return None
    vals = top_vals.masked_fill(use_k[:, None] & (top_vals < kth), float("-inf"))
    # probabilities under the row's filtered distribution: top-k rows normalise over their kept set
    # (inside the K), the others over the whole vocabulary
    lse = torch.where(use_k, torch.logsumexp(vals, dim=-1), full_lse)
    probs = torch.exp(vals - lse[:, None])
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_before >= ps[:, None]) & use_p[:, None]
    drop[:, 0] = False
    vals = vals.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(out, float("-inf")).scatter(-1, top_idx, vals)
    return torch.where(active[:, None], filtered, out)
