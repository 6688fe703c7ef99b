"""``mstar bench compare policy`` in small: the load generator over the websocket policy route
(pi05-tiny's sizes, dummy weights), the figures it derives, and, when the reference virtualenv is
present, lerobot's actions for the same weights and observations equal to mstar's."""

from __future__ import annotations

import numpy as np
import pytest

from mstar.bench import policy_bench as pb
from mstar.models.pi05.config import PI05_TINY

pytest.importorskip("websockets")


def test_load_result_figures():
    r = pb.LoadResult("mstar", 2, [0.1, 0.2, 0.3, 0.4], wall_s=0.5, horizon=50)
    assert r.chunks_per_s == pytest.approx(8.0) and r.actions_per_s == pytest.approx(400.0)
    assert r.percentile(50) in (0.2, 0.3) and r.percentile(95) == 0.4 and r.percentile(0) == 0.1


def test_requests_are_deterministic_and_shaped():
    a, b = pb.make_requests(PI05_TINY, 2, text_tokens=8), pb.make_requests(PI05_TINY, 2, text_tokens=8)
    assert np.array_equal(a[1].cameras["base_0_rgb"], b[1].cameras["base_0_rgb"])
    assert a[0].cameras["right_wrist_0_rgb"].shape == (56, 56, 3) and a[0].token_ids[0] == 2
    assert a[0].noise.shape == (PI05_TINY.horizon, PI05_TINY.action_dim)
    assert not np.array_equal(a[0].noise, a[1].noise)


def test_mstar_under_load_answers_every_client_with_its_own_actions():
    reqs = pb.make_requests(PI05_TINY, 3, text_tokens=8)
    results, first = pb.run_mstar(PI05_TINY, None, reqs, [1, 3], per_client=2, workers="inline")
    assert [r.concurrency for r in results] == [1, 3]
    assert len(results[0].latencies) == 3 and len(results[1].latencies) == 6
    assert all(r.chunks_per_s > 0 and r.percentile(95) >= r.percentile(50) for r in results)
    assert first.shape == (3, PI05_TINY.horizon, PI05_TINY.action_dim) and np.isfinite(first).all()
    assert not np.allclose(first[0], first[1])  # each observation got its own chunk


def test_format_compare_names_both_systems():
    ref = pb.LoadResult("lerobot", 1, [0.2, 0.2], 0.4, 50)
    ours = [pb.LoadResult("mstar", 8, [0.1] * 8, 0.2, 50)]
    text = pb.format_compare(pb.PolicyCompare(ref, ours, 1e-7, "lerobot x"))
    assert "| lerobot | 1 (serial) | 5.00 |" in text and "| mstar | 8 | 40.00 | 2000 |" in text and "8.00x" in text


def test_missing_reference_venv_is_a_clear_error(tmp_path):
    with pytest.raises(pb.ReferenceUnavailable, match="make ref-pi05"):
        pb.reference_python(tmp_path / "nowhere")


@pytest.mark.slow
def test_reference_and_mstar_compute_the_same_actions(tmp_path):
    try:
        pb.reference_python()
    except pb.ReferenceUnavailable as e:
        pytest.skip(str(e))
    cfg = PI05_TINY
    checkpoint = pb.ensure_checkpoint(cfg, tmp_path / "ckpt")
    reqs = pb.make_requests(cfg, 2, text_tokens=8)
    with pb.ReferencePolicy(cfg, checkpoint, threads=1) as ref:
        timing, ref_actions = ref.run(reqs)
        assert "lerobot" in ref.desc and len(timing.latencies) == 2
    _, ours = pb.run_mstar(cfg, checkpoint, reqs, [1], per_client=1, workers="inline")
    np.testing.assert_allclose(ours, ref_actions, atol=1e-5)
