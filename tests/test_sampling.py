"""Tests for mstar.layers.sampling."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from mstar.layers.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k_top_p,
    row_seed,
    sample,
)

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# --------------------------------------------------------------------------------------------------------
# Hand-written references (row by row, HF formulations)
# --------------------------------------------------------------------------------------------------------


def ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= row.numel():
        return row.clone()
    kth = torch.topk(row, k).values[-1]
    return row.masked_fill(row < kth, float("-inf"))


def ref_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    """HF TopPLogitsWarper formulation: ascending sort, drop tokens with cumulative mass <= 1 - p."""
    if p >= 1.0:
        return row.clone()
    vals, idx = torch.sort(row, descending=False)
    cum = vals.softmax(-1).cumsum(-1)
    remove = cum <= (1 - p)
    remove[-1] = False
    out = row.clone()
    out[idx[remove]] = float("-inf")
    return out


def ref_rep_penalty(row: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    out = row.clone()
    for t in set(seen):
        v = out[t].item()
        out[t] = v / penalty if v > 0 else v * penalty
    return out


def nucleus_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    return torch.softmax(ref_top_p(logits.float() / temperature, top_p), -1)


def one(logits_row: torch.Tensor, p: SamplingParams, seen: list[int] | None, step: int) -> int:
    return int(sample(logits_row[None], [p], None if seen is None else [seen], [step])[0])


# --------------------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0.0)] * 6
    out = sample(logits, params, None, [0] * 6)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_ignores_seed_and_step() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    expected = logits.argmax(-1)
    for seed in (None, 0, 7, 123456789):
        for step in (0, 5):
            params = [SamplingParams(temperature=0.0, seed=seed, top_k=5, top_p=0.5)] * 4
            assert torch.equal(sample(logits, params, None, [step] * 4), expected)


def test_greedy_applies_repetition_penalty() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert int(sample(logits, [p], [[0]], [0])[0]) == 1  # 3.0 / 2 = 1.5 < 2.0
    assert int(sample(logits, [p], None, [0])[0]) == 0


def test_low_precision_and_no_mutation() -> None:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3, 40, generator=g)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        logits = base.to(dtype)
        before = logits.clone()
        params = [SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.3, top_k=10, top_p=0.9)] * 3
        out = sample(logits, params, [[1, 2], [3], []], [0, 1, 2])
        assert out.dtype == torch.int64 and out.shape == (3,)
        assert ((out >= 0) & (out < 40)).all()
        assert torch.equal(logits, before)


# --------------------------------------------------------------------------------------------------------
# Seeded sampling and batch invariance
# --------------------------------------------------------------------------------------------------------


def test_same_seed_and_step_same_token() -> None:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1000, generator=g)
    p = SamplingParams(temperature=1.0, seed=42)
    for step in range(10):
        assert one(row, p, None, step) == one(row, p, None, step)


def test_seeded_draws_vary_with_step_and_seed() -> None:
    row = torch.zeros(1000)  # uniform: collisions are rare
    by_step = {one(row, SamplingParams(seed=42), None, s) for s in range(20)}
    by_seed = {one(row, SamplingParams(seed=s), None, 0) for s in range(20)}
    assert len(by_step) > 15 and len(by_seed) > 15


def test_row_seed_properties() -> None:
    seeds = {row_seed(s, t) for s in range(-3, 30) for t in range(50)}
    assert len(seeds) == 33 * 50
    assert all(0 <= x < 2**63 for x in seeds)
    assert row_seed(5, 7) == row_seed(5, 7)


def _random_params(g: torch.Generator) -> SamplingParams:
    r = torch.rand(6, generator=g).tolist()
    seed = None if r[0] < 0.25 else int(torch.randint(0, 2**31, (1,), generator=g))
    return SamplingParams(
        temperature=0.0 if r[1] < 0.2 else 0.3 + 1.2 * r[2],
        top_k=0 if r[3] < 0.5 else int(1 + 20 * r[3]),
        top_p=1.0 if r[4] < 0.5 else 0.5 + 0.5 * r[4],
        repetition_penalty=1.0 if r[5] < 0.5 else 1.0 + r[5],
        seed=seed,
    )


@pytest.mark.parametrize("trial", range(12))
def test_batch_invariance(trial: int) -> None:
    vocab = 64
    g = torch.Generator().manual_seed(1000 + trial)
    target_logits = torch.randn(vocab, generator=g) * 0.5
    target_params = SamplingParams(
        temperature=[0.7, 1.0, 1.5][trial % 3],
        top_k=[0, 20][trial % 2],
        top_p=[1.0, 0.95, 0.8][trial % 3],
        repetition_penalty=[1.0, 1.2][(trial // 2) % 2],
        seed=trial * 7919 + 1,
    )
    target_seen = torch.randint(0, vocab, (10,), generator=g).tolist()
    target_step = trial * 3

    alone = one(target_logits, target_params, target_seen, target_step)

    for position in (0, 3, 7):
        others = torch.randn(8, vocab, generator=g) * 2.0
        logits = others.clone()
        logits[position] = target_logits
        params = [_random_params(g) for _ in range(8)]
        params[position] = target_params
        seen = [
            torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
            for _ in range(8)
        ]
        seen[position] = target_seen
        steps = torch.randint(0, 100, (8,), generator=g).tolist()
        steps[position] = target_step
        out = sample(logits, params, seen, steps)
        assert int(out[position]) == alone, f"position {position}"
        # the same batch in bf16 still yields a valid token for every row
        assert ((out >= 0) & (out < vocab)).all()


def test_batch_invariance_many_rows_one_call() -> None:
    """Rows of one big batch agree with the same rows sampled one at a time."""
    vocab = 32
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, vocab, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=(i % 3) * 5, seed=i) for i in range(40)]
    steps = list(range(40))
    batched = sample(logits, params, None, steps)
    singles = [one(logits[i], params[i], None, steps[i]) for i in range(40)]
    assert batched.tolist() == singles
    # reversed order gives the reversed answer
    rev = sample(logits.flip(0), params[::-1], None, steps[::-1])
    assert rev.tolist() == singles[::-1]


def test_unseeded_rows_valid() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 20, generator=g)
    out = sample(logits, [SamplingParams(top_k=3)] * 5, None, [0] * 5)
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(out[i]) in top3[i].tolist() for i in range(5))


# --------------------------------------------------------------------------------------------------------
# top-k / top-p
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 0, 99])
def test_top_k_1_equals_greedy(seed: int | None) -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 100, generator=g)
    params = [SamplingParams(temperature=1.3, top_k=1, seed=seed)] * 8
    assert torch.equal(sample(logits, params, None, list(range(8))), logits.argmax(-1))


@pytest.mark.parametrize("seed", [None, 0, 99])
def test_tiny_top_p_equals_greedy(seed: int | None) -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 100, generator=g)
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=seed)] * 8
    assert torch.equal(sample(logits, params, None, list(range(8))), logits.argmax(-1))


def test_top_k_top_p_match_reference_per_row() -> None:
    g = torch.Generator().manual_seed(9)
    batch, vocab = 24, 50
    logits = torch.randn(batch, vocab, generator=g) * 2
    ks = [[0, 1, 5, 17, 49, 50, 80][i % 7] for i in range(batch)]
    ps = [[1.0, 0.9, 0.5, 0.3, 0.99, 0.05][i % 6] for i in range(batch)]
    out = apply_top_k_top_p(logits, ks, ps)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for i in range(batch):
        ref = ref_top_p(ref_top_k(logits[i], ks[i]), ps[i])
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref)), f"row {i}"
        kept = ~torch.isinf(ref)
        assert torch.equal(out[i][kept], logits[i][kept])


def test_top_k_keeps_ties_and_disabled_is_identity() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, [1], [1.0])
    assert torch.isinf(out).tolist() == [[True, False, False, True]]
    assert torch.equal(apply_top_k_top_p(logits, [0], [1.0]), logits)


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    kept = lambda p: (~torch.isinf(apply_top_k_top_p(logits, [0], [p])[0])).sum().item()  # noqa: E731
    assert kept(0.4) == 1
    assert kept(0.7) == 2
    assert kept(0.85) == 3
    assert kept(0.9) == 3
    assert kept(0.99) == 4


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")
def test_processors_match_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 60, generator=g)
    ids = torch.randint(0, 60, (4, 12), generator=g)
    for k in (1, 5, 30):
        ref = TopKLogitsWarper(top_k=k)(ids, logits.clone())
        assert torch.equal(torch.isinf(apply_top_k_top_p(logits, [k] * 4, [1.0] * 4)), torch.isinf(ref))
    for p in (0.3, 0.8, 0.95):
        ref = TopPLogitsWarper(top_p=p)(ids, logits.clone())
        assert torch.equal(torch.isinf(apply_top_k_top_p(logits, [0] * 4, [p] * 4)), torch.isinf(ref))
    ref = RepetitionPenaltyLogitsProcessor(penalty=1.7)(ids, logits.clone())
    ours = apply_repetition_penalty(logits, ids.tolist(), [1.7] * 4)
    torch.testing.assert_close(ours, ref)


# --------------------------------------------------------------------------------------------------------
# Repetition penalty and temperature
# --------------------------------------------------------------------------------------------------------


def test_repetition_penalty_hand_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -4.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    seen = [[0, 1, 1, 4, 5, 5], [2]]
    out = apply_repetition_penalty(logits, seen, [2.0, 1.0])
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0, 0.0, -8.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    assert torch.equal(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, -4.0]))  # not in place
    # penalty < 1 encourages repetition, and matches the reference formula
    out2 = apply_repetition_penalty(logits, seen, [0.5, 0.5])
    for i in range(2):
        assert torch.equal(out2[i], ref_rep_penalty(logits[i], seen[i], 0.5))
    # no seen tokens: identity
    assert torch.equal(apply_repetition_penalty(logits, None, [2.0, 2.0]), logits)


def test_repetition_penalty_takes_tensors_lists_and_empty_rows() -> None:
    """Rows as id lists, 1-D tensors (any integer dtype), None or empty, with repeated ids and a
    penalty of 1: each row's logits are those of the per-row reference, bit for bit."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g) * 3
    ids = [torch.randint(0, 40, (n,), generator=g) for n in (9, 0, 25, 4, 12, 30)]
    penalties = [1.3, 2.0, 0.7, 1.0, 1.9, 1.15]
    seen = [ids[0].tolist(), ids[1], ids[2].to(torch.int32), ids[3], None, ids[5]]
    out = apply_repetition_penalty(logits, seen, penalties)
    for i, (s, p) in enumerate(zip(seen, penalties)):
        want = logits[i].clone()  # the penalty in float32, once per distinct id, one row at a time
        pen = torch.tensor(p, dtype=torch.float32)
        for t in set() if s is None or p == 1.0 else {int(t) for t in s}:
            want[t] = want[t] / pen if want[t] > 0 else want[t] * pen
        assert torch.equal(out[i], want), i
        if s is not None and p != 1.0 and len(s):
            assert not torch.equal(out[i], logits[i])
    with pytest.raises(ValueError, match="in row 2: 40"):
        apply_repetition_penalty(logits, [[1], None, torch.tensor([3, 40]), [41], None, None], [1.5] * 6)


def test_repetition_penalty_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="out of range"):
        apply_repetition_penalty(torch.zeros(1, 4), [[4]], [1.5])
    with pytest.raises(ValueError, match="out of range"):
        apply_repetition_penalty(torch.zeros(1, 4), [[-1]], [1.5])


def test_temperature() -> None:
    logits = torch.tensor([[2.0, -1.0], [2.0, -1.0]])
    out = apply_temperature(logits, [0.5, 0.0])
    assert torch.equal(out, torch.tensor([[4.0, -2.0], [2.0, -1.0]]))


# --------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------

# chi-square critical values at alpha = 1e-3, indexed by degrees of freedom
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson statistic over the support; bins with expected count < 5 are pooled into one."""
    support = probs > 0
    assert counts[~support].sum().item() == 0, "token outside the support was sampled"
    expected = (probs[support] * n).double()
    observed = counts[support].double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        if expected[-1] < 5:  # pooled tail still small: fold it into the smallest regular bin
            j = int(expected[:-1].argmin())
            expected[j] += expected[-1]
            observed[j] += observed[-1]
            expected, observed = expected[:-1], observed[:-1]
    stat = (((observed - expected) ** 2) / expected).sum().item()
    return stat, expected.numel() - 1


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [(0.7, 1.0), (1.0, 0.9), (0.7, 0.9)],
)
def test_empirical_frequencies_match_softmax(temperature: float, top_p: float) -> None:
    n = 2000
    row = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -3.0, -4.0])
    probs = nucleus_probs(row, temperature, top_p)
    if top_p < 1:
        assert (probs == 0).sum() >= 1  # the nucleus actually truncates
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=2024)] * n
    tokens = sample(row.expand(n, -1), params, None, list(range(n)))
    counts = torch.bincount(tokens, minlength=row.numel())
    stat, dof = _chi_square(counts, probs, n)
    assert stat < _CHI2_999[dof], (stat, dof, counts.tolist(), (probs * n).tolist())
    # and a loose absolute bound on each frequency
    assert (counts / n - probs).abs().max().item() < 4 * math.sqrt(0.25 / n)


def test_unseeded_frequencies_plausible() -> None:
    n = 2000
    row = torch.tensor([1.0, 0.0, -1.0])
    tokens = sample(row.expand(n, -1), [SamplingParams()] * n, None, [0] * n)
    freq = torch.bincount(tokens, minlength=3) / n
    assert (freq - row.softmax(-1)).abs().max().item() < 0.06


# --------------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_params_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalisation() -> None:
    p = SamplingParams(temperature=1, top_p=1, stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop_token_ids == (3, 4)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    hash(p)  # frozen + hashable


def test_from_dict() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": None, "seed": 3, "stop_token_ids": [1, 2]})
    assert p == SamplingParams(temperature=0.5, seed=3, stop_token_ids=(1, 2))
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError) as ei:
        SamplingParams.from_dict({"temperature": 0.5, "min_p": 0.1})
    msg = str(ei.value)
    assert "min_p" in msg
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "seed",
        "max_tokens",
        "stop_token_ids",
        "ignore_eos",
    ):
        assert name in msg
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2})


def test_sample_argument_checks() -> None:
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams()], None, [0, 0])
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams()] * 2, None, [0])
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams()] * 2, [[1]], [0, 0])
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams()] * 2, None, [0, -1])
    with pytest.raises(ValueError):
        sample(torch.zeros(5), [SamplingParams()], None, [0])
    assert sample(torch.zeros(0, 5), [], None, []).shape == (0,)


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])
def test_partial_top_k_top_p_equals_full_sort(monkeypatch, scale):
    import mstar.layers.logit_filters as smp

    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, 3000, generator=g) * scale
    logits[0, :5] = 50.0  # ties at the top
    top_k = [0, 5, 300, 0, 40, 0]
    top_p = [0.9, 1.0, 0.8, 0.5, 0.95, 1.0]
    fast = smp.apply_top_k_top_p(logits, top_k, top_p)
    monkeypatch.setattr(smp, "_PARTIAL_K", 10**9)  # force the full sort
    full = smp.apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(fast), torch.isinf(full))
    assert torch.equal(fast[~torch.isinf(fast)], full[~torch.isinf(full)])


def test_mostly_masked_rows_filter_their_finite_part_alone() -> None:
    """Rows with < 1/4 of their logits finite (constrained decoding) are filtered on those alone:
    the same kept set as the per-row reference, and a row's result does not depend on its batch
    (rows with other numbers of finite entries are grouped apart, never padded)."""
    g = torch.Generator().manual_seed(4)
    batch, vocab = 6, 4000
    logits = torch.full((batch, vocab), float("-inf"))
    counts = [300, 300, 120, 999, 300, 0]
    for i, n in enumerate(counts):
        cols = torch.randperm(vocab, generator=g)[:n]
        logits[i, cols] = torch.randn(n, generator=g) * 3
    ks = [0, 40, 0, 2000, 350, 0]  # 2000 and 350: between the row's finite count and V
    ps = [0.8, 1.0, 0.5, 0.9, 0.7, 0.8]
    out = apply_top_k_top_p(logits, ks, ps)
    for i in range(batch):
        ref = ref_top_p(ref_top_k(logits[i], ks[i]), ps[i])
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref)), f"row {i}"
        assert torch.equal(out[i][~torch.isinf(ref)], logits[i][~torch.isinf(ref)])
        alone = apply_top_k_top_p(logits[i:i + 1], [ks[i]], [ps[i]])
        assert torch.equal(alone[0], out[i])
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=p, repetition_penalty=1.2, seed=i)
              for i, (k, p) in enumerate(zip(ks, ps))][:5]
    seen = [[int(c) for c in torch.isfinite(logits[i]).nonzero()[:3, 0]] for i in range(5)]
    together = sample(logits[:5], params, seen, [3] * 5)
    for i in range(5):
        assert int(together[i]) == one(logits[i], params[i], seen[i], 3)
        assert math.isfinite(float(logits[i, together[i]]))


def test_inverse_cdf_draw_edges() -> None:
    """The one-uniform draw: a weight that underflows to 0 is never drawn, u = 0 takes the first
    positive weight, u just below 1 the last, and the draw follows the cumulative weights."""
    from mstar.layers.sampling import _draw

    vals = torch.tensor([0.0, -800.0, 0.0])  # exp(-800) underflows even in float64
    assert {_draw(vals, u / 1000) for u in range(1000)} == {0, 2}
    assert _draw(vals, 0.0) == 0 and _draw(vals, 1 - 1e-16) == 2
    probs = torch.tensor([0.1, 0.6, 0.3])
    picks = [_draw(probs.log(), u) for u in (0.05, 0.099, 0.101, 0.69, 0.71, 0.99)]
    assert picks == [0, 0, 1, 1, 2, 2]


def test_openai_options_are_row_wise_and_logprobs_match_the_processed_logits() -> None:
    """Bias, presence / frequency penalties (over the generated tail of the seen tokens only) and
    logprobs: each row alone gives the tokens and logprobs it gets in a mixed batch, greedy and
    seeded; logprobs are the log-softmax of the biased, penalised logits, top-k sorted."""
    from mstar.layers.sampling import sample_with_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    seen = [torch.tensor([1, 2, 3, 7, 7, 9]), None, torch.tensor([4, 4, 4, 5]), torch.tensor([0, 1])]
    steps = [3, 0, 2, 1]  # the last `step` seen tokens are the generated ones
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={9: 2.0},
                             logprobs=3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=5, frequency_penalty=-1.0, logprobs=0),
              SamplingParams(temperature=0.0, logit_bias={"2": 100}, logprobs=20)]
    tokens, lps = sample_with_logprobs(logits, params, seen, steps)
    for i in range(4):
        alone, alone_lp = sample_with_logprobs(logits[i:i + 1], [params[i]], [seen[i]], [steps[i]])
        assert int(alone[0]) == int(tokens[i])
        assert (alone_lp[0] is None) == (lps[i] is None)
        if lps[i] is not None:
            assert torch.equal(alone_lp[0].ids, lps[i].ids) and torch.equal(alone_lp[0].logprobs, lps[i].logprobs)
    assert lps[1] is None and int(tokens[3]) == 2  # a +100 bias wins the argmax
    want = logits[0].clone()
    want[9] += 2.0
    want[7] -= 1.0 + 2 * 0.5  # generated: 7, 7, 9 (1, 2, 3 are the prompt's)
    want[9] -= 1.0 + 0.5
    ref = torch.log_softmax(want, -1)
    assert int(tokens[0]) == int(want.argmax())
    assert lps[0].ids.tolist() == [int(tokens[0]), *torch.topk(ref, 3).indices.tolist()]
    torch.testing.assert_close(lps[0].logprobs, torch.cat([ref[tokens[0]].reshape(1), torch.topk(ref, 3).values]))
    assert lps[2].ids.shape == (1,) and lps[3].ids.shape == (21,)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
