"""pi0.5 through the Runtime: the fixture's actions from a checkpoint directory, batching and
placement invariance, a read-only prefix cache during the flow loop, nothing left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar import Runtime
from mstar.layers.paged_attention import QueryMode
from mstar.layers.prepack import prepack_available
from mstar.model import resolve_model
from mstar.models.pi05.config import PI05_TINY, Pi05Request
from mstar.models.pi05.model import Pi05Model, Pi05Tiny
from mstar.placement import Placement
from tests.helpers import kv_blocks_in_use

FIXTURE = Path(__file__).parent / "fixtures" / "pi05" / "pi05_tiny.safetensors"
PLACEMENTS = Path(__file__).resolve().parents[1] / "examples" / "placements"
ATOL = 1e-5


@pytest.fixture(scope="module")
def fixture():
    raw = load_file(str(FIXTURE))
    return {k: v for k, v in raw.items() if not k.startswith("w.")}, {k[2:]: v for k, v in raw.items()
                                                                          if k.startswith("w.")}


@pytest.fixture(scope="module")
def checkpoint(fixture, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pi05_ckpt")
    save_file(fixture[1], str(path / "model.safetensors"))
    return path


def fixture_request(data, b: int) -> Pi05Request:
    return Pi05Request(images=data["in.images"][:, b], image_masks=data["in.img_masks"][:, b],
                       token_ids=data["in.tokens"][b], token_mask=data["in.masks"][b], noise=data["in.noise"][b])


def random_request(seed: int, masked: bool = False, pad: int = 0) -> Pi05Request:
    g = torch.Generator().manual_seed(seed)
    s = PI05_TINY.vision.image_size
    ids = torch.randint(0, PI05_TINY.vocab_size, (12 + seed % 5 + pad,), generator=g)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    if pad:
        mask[-pad:] = False
    return Pi05Request(images=torch.rand(3, 3, s, s, generator=g) * 2 - 1,
                       image_masks=torch.tensor([True, True, not masked]), token_ids=ids, token_mask=mask, seed=seed)


def run(rt: Runtime, reqs: list[Pi05Request]) -> list[torch.Tensor]:
    """The requests' actions; they arrive together (held), so they start in the same step."""
    with rt.held():
        handles = [rt.submit(*r.to_runtime()) for r in reqs]
    outs = [h.result() for h in handles]
    for o in outs:
        assert o.finished, o.error
    return [o.tensors("actions")[0] for o in outs]


@pytest.mark.parametrize("prepack", [False, True])
def test_actions_from_a_checkpoint_match_the_reference(fixture, checkpoint, prepack):
    """Plain and oneDNN-prepacked projections (where the oneDNN ops exist) both within 1e-5."""
    data = fixture[0]
    model = Pi05Model(model_path=checkpoint, config=PI05_TINY, prepack=prepack)
    with Runtime(model) as rt:
        mlp = rt.local_module("prefix").expert.layers[0].mlp
        assert (mlp.prepacked is not None) == (prepack and prepack_available())
        got = run(rt, [fixture_request(data, 0), fixture_request(data, 1)])
        assert kv_blocks_in_use(rt) == 0
    for b in (0, 1):
        assert got[b].dtype == torch.float32 and got[b].shape == (50, 32)
        torch.testing.assert_close(got[b], data["out.actions"][b], atol=ATOL, rtol=0)


def test_batched_requests_give_the_actions_they_get_alone():
    reqs = [random_request(1), random_request(2, masked=True), random_request(3, pad=4)]
    with Runtime(resolve_model("pi05-tiny")) as rt:
        alone = [run(rt, [r])[0] for r in reqs]
        together = run(rt, reqs)
        sizes = rt.stats()["ranks"][0]["batch_sizes"]
        assert kv_blocks_in_use(rt) == 0
    assert max(sizes["vision"]) == 3  # the three requests' cameras in one tower call
    assert max(sizes["prefix"]) == 3  # prefix passes and flow steps of the three requests batched
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


@pytest.mark.parametrize("workers", ["inline", "process"])
def test_vision_on_its_own_rank_gives_the_same_actions(workers):
    """Two ranks (image embeddings cross between them; in process mode over the wire format)."""
    reqs = [random_request(4), random_request(5, masked=True, pad=3)]
    with Runtime(resolve_model("pi05-tiny"), PLACEMENTS / "pi05_single.yaml") as rt:
        one_rank = run(rt, reqs)
    placement = Placement.load(PLACEMENTS / "pi05_vision_rank.yaml")
    with Runtime(resolve_model("pi05-tiny"), placement, workers=workers) as rt:
        two_ranks = run(rt, reqs)
        assert kv_blocks_in_use(rt) == 0
    for a, b in zip(one_rank, two_ranks):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_the_flow_loop_never_writes_the_prefix_cache():
    """Every forward's read-only sequences (flow steps) find their cache blocks unchanged after it."""
    checked = []
    with Runtime(resolve_model("pi05-tiny")) as rt:
        engine = rt.local_engine("prefix")
        forward = engine.module.forward

        def guarded(walk, ei, **tensors):
            meta, bs = ei.attention, engine.kv_caches[0][0].shape[1]
            blocks = sorted({b for i, mode in enumerate(meta.modes) if mode is QueryMode.READ_ONLY
                             for b in meta.block_tables[i][:-(-int(meta.context_lens[i]) // bs)]})
            before = [t[blocks].clone() for kv in engine.kv_caches for t in kv]
            out = forward(walk, ei, **tensors)
            after = [t[blocks] for kv in engine.kv_caches for t in kv]
            checked.append(len(blocks))
            assert all(torch.equal(a, b) for a, b in zip(before, after))
            return out

        engine.module.forward = guarded
        run(rt, [random_request(6), random_request(7, masked=True), random_request(8, pad=2)])
        assert kv_blocks_in_use(rt) == 0
    assert sum(1 for n in checked if n) >= PI05_TINY.num_steps  # the flow steps were checked


def test_seed_and_noise():
    r = random_request(9)
    with Runtime(resolve_model("pi05-tiny")) as rt:
        a, b = run(rt, [r])[0], run(rt, [r])[0]
        c, = run(rt, [Pi05Request(r.images, r.image_masks, r.token_ids, r.token_mask, seed=10)])
    assert torch.equal(a, b)  # same seed, same noise: the same actions
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("change, fragment", [
    (lambda r: {"images": [r.images[:, :, :28]]}, "images must be"),
    (lambda r: {"image_masks": [torch.zeros(3, dtype=torch.bool)]}, "at least one camera"),
    (lambda r: {"image_masks": [torch.ones(2, dtype=torch.bool)]}, "image_masks must be"),
    (lambda r: {"token_ids": [torch.tensor([1, 2, PI05_TINY.vocab_size])]}, "token ids must be in"),
    (lambda r: {"images": [torch.full_like(r.images, float("nan"))]}, "finite"),
    (lambda r: {"noise": [torch.zeros(3, 32)]}, "noise must be"),
    (lambda r: {"state": [torch.zeros(8)]}, "unknown inputs"),
])
def test_bad_requests_are_rejected(change, fragment):
    r = random_request(11)
    inputs, params = r.to_runtime()
    inputs.update(change(r))
    if "token_ids" in change(r):
        inputs["token_mask"] = [torch.ones(3, dtype=torch.bool)]
    with Runtime(resolve_model("pi05-tiny")) as rt:
        with pytest.raises(ValueError, match=fragment):
            rt.submit(inputs, params)
        assert kv_blocks_in_use(rt) == 0


def test_bfloat16_runs_close_to_float32():
    reqs = [random_request(12), random_request(13, masked=True)]
    with Runtime(Pi05Tiny(dtype="bfloat16")) as rt:
        half = run(rt, reqs)
        assert kv_blocks_in_use(rt) == 0
    with Runtime(Pi05Tiny()) as rt:
        full = run(rt, reqs)
    for a, b in zip(half, full):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)  # bf16 weights and cache (measured ~1.5e-2)


def test_a_prefix_larger_than_the_cache_is_refused():
    placement = Placement.from_dict({"model": "pi05-tiny", "runtime": {"kv_cache_blocks": 2, "kv_block_size": 16},
                                     "node_groups": [{"node_names": ["vision", "prefix", "expert"], "ranks": [0]}]})
    with Runtime(resolve_model("pi05-tiny"), placement) as rt:
        with pytest.raises(ValueError, match="prefix"):
            rt.submit(*random_request(14).to_runtime())  # 3 cameras x 16 + text tokens > 32
        small = Pi05Request(torch.zeros(1, 3, 56, 56), torch.tensor([True]), torch.tensor([2, 5, 9]), seed=1)
        assert run(rt, [small])[0].shape == (50, 32)
        assert kv_blocks_in_use(rt) == 0


def test_requests_beyond_the_cache_wait_and_get_their_actions():
    """A cache that holds two prefixes at a time (4 blocks each), six requests at once: the rest wait
    (or are swapped out) and every request still gets the actions it gets alone."""
    reqs = [random_request(20 + i, masked=i % 2 == 1) for i in range(6)]
    with Runtime(resolve_model("pi05-tiny")) as rt:
        alone = [run(rt, [r])[0] for r in reqs]
    placement = Placement.from_dict({"model": "pi05-tiny", "runtime": {"kv_cache_blocks": 9, "kv_block_size": 16},
                                     "node_groups": [{"node_names": ["vision", "prefix", "expert"], "ranks": [0]}]})
    with Runtime(resolve_model("pi05-tiny"), placement) as rt:
        together = run(rt, reqs)
        assert max(rt.stats()["ranks"][0]["batch_sizes"]["prefix"]) <= 3  # at most 9 blocks' worth at once
        assert kv_blocks_in_use(rt) == 0
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_masked_camera_pixels_and_padded_ids_change_nothing():
    r = random_request(15, masked=True, pad=5)
    images = r.images.clone()
    images[2] = torch.rand_like(images[2])  # the masked camera
    ids = r.token_ids.clone()
    ids[-5:] = 3  # the padding
    other = Pi05Request(images, r.image_masks, ids, r.token_mask, seed=r.seed)
    with Runtime(resolve_model("pi05-tiny")) as rt:
        a, b = run(rt, [r])[0], run(rt, [other])[0]  # each alone: the same computation, bit for bit
    assert torch.equal(a, b)
