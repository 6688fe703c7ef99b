"""V-JEPA 2-AC through the runtime: the cached rollout (one frame block appended per loop iteration)
equals the native rollout that re-runs the predictor over the whole trajectory at every step."""

import httpx
import pytest
import torch

from mstar import Runtime
from mstar.bench.vjepa2_oracle import native_rollout
from mstar.model import resolve_model
from mstar.models.vjepa2.encoder import encode_frames
from mstar.models.vjepa2.graph import MAX_FRAMES
from mstar.models.vjepa2.pose import compute_new_pose, euler_xyz_to_matrix, matrix_to_euler_xyz
from mstar.placement import Placement
from tests.helpers import kv_blocks_in_use
from tests.server_utils import running_server


def request(seed: int, t: int, horizon: int):
    g = torch.Generator().manual_seed(seed)
    return ({"frames": torch.randn(t, 3, 32, 32, generator=g), "states": torch.rand(t, 7, generator=g),
             "actions": torch.randn(t + horizon - 1, 7, generator=g) * 0.1}, {"horizon": horizon})


def check_against_native(rt, reqs, outs):
    enc = rt.local_module("encoder").encoder
    pred = rt.local_module("predictor").predictor
    for (inputs, params), out in zip(reqs, outs):
        assert out.finished, out.error
        t = inputs["frames"].shape[0]
        ctx = encode_frames(enc, inputs["frames"][None])[0].view(t, -1, 64)
        ref = native_rollout(pred, ctx, inputs["states"], inputs["actions"], params["horizon"])
        got = out.tensors("frame")
        assert len(got) == params["horizon"]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_cached_rollout_equals_native_for_batched_requests():
    reqs = [request(0, 2, 4), request(1, 1, 3), request(2, 3, 1), request(3, 2, 6)]
    with Runtime(resolve_model("vjepa2-ac-tiny")) as rt:
        outs = [h.result() for h in [rt.submit(i, p) for i, p in reqs]]
        check_against_native(rt, reqs, outs)
        assert max(rt.stats()["ranks"][0]["batch_sizes"]["predictor"]) > 1  # rollouts of requests batched
        assert kv_blocks_in_use(rt) == 0


def test_rollout_is_placement_invariant():
    reqs = [request(4, 2, 3), request(5, 2, 2)]
    placement = Placement.from_dict({"model": "vjepa2-ac-tiny", "node_groups": [
        {"node_names": ["encoder"], "ranks": [0]}, {"node_names": ["predictor"], "ranks": [1]}]})
    with Runtime(resolve_model("vjepa2-ac-tiny"), placement) as rt:
        outs = [h.result() for h in [rt.submit(i, p) for i, p in reqs]]
        check_against_native(rt, reqs, outs)


@pytest.mark.parametrize("bad, fragment", [
    (lambda i, p: ({**i, "frames": torch.randn(2, 3, 16, 16)}, p), "frames must be"),
    (lambda i, p: ({**i, "actions": torch.randn(4, 6)}, p), "actions must be"),
    (lambda i, p: (i, {"horizon": MAX_FRAMES}), "must be at most"),
    (lambda i, p: ({k: v for k, v in i.items() if k != "states"}, p), "'states' is required"),
])
def test_bad_inputs_are_rejected(bad, fragment):
    with Runtime(resolve_model("vjepa2-ac-tiny")) as rt:
        inputs, params = bad(*request(6, 2, 3))
        with pytest.raises(ValueError, match=fragment):
            rt.submit(inputs, params)


def test_pose_integration():
    g = torch.Generator().manual_seed(0)
    angles = (torch.rand(5, 3, generator=g) - 0.5) * 2.0
    torch.testing.assert_close(matrix_to_euler_xyz(euler_xyz_to_matrix(angles)), angles, atol=1e-5, rtol=0)
    pose = torch.cat([torch.rand(5, 3, generator=g), angles, torch.full((5, 1), 0.9)], -1)
    action = torch.cat([torch.full((5, 3), 0.1), angles.flip(0) * 0.3, torch.full((5, 1), 0.5)], -1)
    new = compute_new_pose(pose, action)
    torch.testing.assert_close(new[:, :3], pose[:, :3] + 0.1)
    assert torch.equal(new[:, 6], torch.ones(5))  # gripper clipped to [0, 1]
    composed = euler_xyz_to_matrix(action[:, 3:6]) @ euler_xyz_to_matrix(pose[:, 3:6])
    torch.testing.assert_close(euler_xyz_to_matrix(new[:, 3:6]), composed, atol=1e-5, rtol=0)


def test_generate_route_streams_predicted_frames_and_rejects_bad_input():
    from mstar.server.media import tensor_to_json

    inputs, params = request(7, 2, 3)
    body = {"inputs": {k: tensor_to_json(v) for k, v in inputs.items()}, "params": params}
    with running_server(resolve_model("vjepa2-ac-tiny"), "vjepa2-ac-tiny") as (url, _):
        r = httpx.post(url + "/generate", json=body, timeout=60)
        lines = [x for x in r.text.splitlines() if x]
        assert r.status_code == 200 and lines[-1] == '{"done": true}'
        frames = [x for x in lines[:-1] if '"name": "frame"' in x]
        assert len(frames) == 3 and '"shape": [4, 64]' in frames[0]
        bad = {**body, "inputs": {**body["inputs"], "actions": tensor_to_json(torch.zeros(4, 5))}}
        r = httpx.post(url + "/generate", json=bad, timeout=60)
        assert r.status_code == 400 and "actions must be" in r.json()["error"]["message"]


def oracle_plan(pred, ctx, states, past_actions, goal, p):
    """CEM written out with the native (re-run) rollout: every candidate re-runs the predictor over its
    whole trajectory at every step; no cache, no forks."""
    import torch.nn.functional as F

    t, n = ctx.shape[0], pred.cfg.tokens_per_frame
    mean = torch.zeros(p["horizon"], 7)
    std = torch.full((p["horizon"], 7), p["init_std"])
    for i in range(p["iterations"]):
        gen = torch.Generator().manual_seed(p["seed"] * 1_000_003 + i)
        cand = mean + std * torch.randn((p["samples"], p["horizon"], 7), generator=gen)
        finals = []
        for k in range(p["samples"]):
            z, s = list(ctx), list(states)
            for j in range(p["horizon"]):
                acts = torch.cat([past_actions[:t - 1], cand[k, :j + 1]])
                with torch.inference_mode():
                    out = pred.forward_full(torch.cat(z)[None], acts[None], torch.stack(s)[None])
                s.append(compute_new_pose(s[-1], acts[-1]))
                z.append(F.layer_norm(out[0, -n:], (out.shape[-1],)))
            finals.append(z[-1])
        energy = torch.stack([(f - goal).abs().mean() for f in finals])
        elite = cand[torch.topk(energy, p["topk"], largest=False).indices]
        mean, std = elite.mean(0), elite.std(0, unbiased=False)
    return mean


@pytest.mark.parametrize("t", [1, 3])
def test_cem_plan_with_forked_sample_caches_equals_oracle(t):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(t)
    ctx = F.layer_norm(torch.randn(t, 4, 64, generator=g), (64,))
    goal = F.layer_norm(torch.randn(4, 64, generator=g), (64,))
    states, past = torch.rand(t, 7, generator=g), torch.randn(max(t - 1, 0), 7, generator=g) * 0.1
    p = {"task": "plan", "horizon": 2, "samples": 6, "topk": 2, "iterations": 3, "seed": 11, "init_std": 0.1}
    with Runtime(resolve_model("vjepa2-ac-tiny")) as rt:
        (out,) = rt.generate([{"context": ctx, "goal": goal, "states": states, "actions": past}], p)
        assert out.finished, out.error
        pred = rt.local_module("predictor").predictor
        assert len(out.tensors("energy")) == p["iterations"]
        assert kv_blocks_in_use(rt) == 0  # the context cache and every sample's fork are freed
    torch.testing.assert_close(out.tensors("plan")[0], oracle_plan(pred, ctx, states, past, goal, p),
                               atol=1e-4, rtol=1e-4)


def test_plan_from_frames_and_goal_frame():
    inputs, _ = request(8, 2, 1)
    g = torch.Generator().manual_seed(9)
    params = {"task": "plan", "horizon": 3, "samples": 8, "topk": 3, "iterations": 2}
    with Runtime(resolve_model("vjepa2-ac-tiny")) as rt:
        (out,) = rt.generate([{**inputs, "actions": inputs["actions"][:1],
                               "goal_frame": torch.randn(3, 32, 32, generator=g)}], params)
        assert out.finished, out.error
        assert out.tensors("plan")[0].shape == (3, 7)
        energies = torch.cat(out.tensors("energy"))
        assert energies.shape == (2,) and bool(torch.isfinite(energies).all())
        with pytest.raises(ValueError, match="goal_frame"):
            rt.submit({**inputs, "actions": inputs["actions"][:1]}, params)


def test_plan_samples_and_rollouts_of_other_requests_batch_together():
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    ctx = F.layer_norm(torch.randn(2, 4, 64, generator=g), (64,))
    goal = F.layer_norm(torch.randn(4, 64, generator=g), (64,))
    states, past = torch.rand(2, 7, generator=g), torch.randn(1, 7, generator=g) * 0.1
    p = {"task": "plan", "horizon": 2, "samples": 4, "topk": 2, "iterations": 2, "seed": 3, "init_std": 0.1}
    rollouts = [request(10, 2, 4), request(11, 3, 3)]
    with Runtime(resolve_model("vjepa2-ac-tiny")) as rt:
        h_plan = rt.submit({"context": ctx, "goal": goal, "states": states, "actions": past}, p)
        h_roll = [rt.submit(i, q) for i, q in rollouts]
        plan = h_plan.result()
        check_against_native(rt, rollouts, [h.result() for h in h_roll])
        pred = rt.local_module("predictor").predictor
        assert max(rt.stats()["ranks"][0]["batch_sizes"]["predictor"]) > 1
    torch.testing.assert_close(plan.tensors("plan")[0], oracle_plan(pred, ctx, states, past, goal, p),
                               atol=1e-4, rtol=1e-4)


def test_generate_route_plans():
    import json

    import torch.nn.functional as F

    from mstar.server.media import tensor_to_json

    g = torch.Generator().manual_seed(12)
    inputs = {"context": F.layer_norm(torch.randn(2, 4, 64, generator=g), (64,)),
              "goal": F.layer_norm(torch.randn(4, 64, generator=g), (64,)),
              "states": torch.rand(2, 7, generator=g), "actions": torch.randn(1, 7, generator=g) * 0.1}
    params = {"task": "plan", "horizon": 2, "samples": 6, "topk": 2, "iterations": 2}
    body = {"inputs": {k: tensor_to_json(v) for k, v in inputs.items()}, "params": params}
    with running_server(resolve_model("vjepa2-ac-tiny"), "vjepa2-ac-tiny") as (url, _):
        r = httpx.post(url + "/generate", json=body, timeout=60)
        items = [json.loads(x) for x in r.text.splitlines() if x]
        assert r.status_code == 200 and items[-1] == {"done": True}
        assert [x["name"] for x in items[:-1]] == ["energy", "energy", "plan"]
        assert items[-2]["tensors"][0]["shape"] == [2, 7]
