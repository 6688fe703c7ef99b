"""bagel-tiny through the runtime: text-to-image, editing and image understanding against a dense
plain-PyTorch oracle (tests/bagel_oracle.py), walk selection, prefix-shared guidance caches, batch and
placement invariance, request validation."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from mstar import Runtime
from mstar.bench.bagel_oracle import (
    Context,
    DenseBagel,
    add_text,
    add_vae,
    add_vit,
    generate_image,
    greedy_decode,
)
from mstar.layers.prepack import prepack_requested
from mstar.models.bagel.model import BagelTiny
from mstar.models.bagel.nodes import CombineCFG
from mstar.models.bagel.request import BagelRequest
from mstar.placement import Placement

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def text(s: str) -> torch.Tensor:
    return torch.tensor([b + 3 for b in s.encode()], dtype=torch.long)


def image(seed: int, h: int = 40, w: int = 52) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


def same_bits_or_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same bits where the projections run through the panel kernel (a row's result does not depend
    on the batch); close on the plain path (F.linear's blocking changes with the row count)."""
    if prepack_requested():
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return BagelTiny()


@pytest.fixture(scope="module")
def oracle(model):
    parts = model.build_submodules(["LLM", "vit_encoder", "vae_encoder"])
    return DenseBagel(parts["LLM"], parts["vit_encoder"].vit, parts["vae_encoder"].vae, model.spec.latent_patch_size)


@pytest.fixture(scope="module")
def rt(model):
    with Runtime(model) as runtime:
        yield runtime


def noise(model, seed, h, w):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, model.spec.latent_dim, generator=g)


def latents(out):
    (lat,) = out.tensors("image_output")
    return lat


def preprocess(model, img):
    pil = model.vae_resize.resize(Image.fromarray(img.numpy(), "RGB"))
    return model.vae_resize.to_tensor(pil), model.vit_resize(pil)


def test_text_to_image_matches_the_dense_oracle(model, oracle, rt):
    prompt = "a red cube on a table"
    params = {"target": "image", "seed": 3, "height": 32, "width": 48, "num_timesteps": 9, "output_type": "latent"}
    (out,) = rt.generate([{"text_ids": [text(prompt)]}], params)
    assert out.finished, out.error
    main = Context()
    cfg_text = main.copy()  # text-to-image: the context without the prompt is empty
    add_text(oracle, main, text(prompt).tolist())
    h, w = 32 // 8, 48 // 8
    ref = generate_image(oracle, main, cfg_text, main, noise(model, 3, h, w), h, w, cfg_text_scale=4.0,
                         cfg_img_scale=1.0, cfg_interval=(0.4, 1.0), renorm_type="global", num_timesteps=9)
    got = latents(out)
    assert got.shape == ref.shape == (h * w, model.spec.latent_dim)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    # the guidance changed the result: without it the oracle differs
    plain = generate_image(oracle, main, cfg_text, main, noise(model, 3, h, w), h, w, cfg_text_scale=1.0,
                           cfg_img_scale=1.0, cfg_interval=(0.4, 1.0), renorm_type="global", num_timesteps=9)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("renorm", ["text_channel", "global", "channel"])
def test_editing_matches_the_dense_oracle(model, oracle, rt, renorm):
    img, prompt = image(1), "make it blue"
    params = {"target": "image", "seed": 5, "num_timesteps": 7, "output_type": "latent", "cfg_renorm_type": renorm,
              "cfg_renorm_min": 0.1 if renorm == "channel" else 0.0}
    (out,) = rt.generate([{"text_ids": [text(prompt)], "images": [img]}], params)
    assert out.finished, out.error
    vae_px, vit_px = preprocess(model, img)
    main, cfg_img = Context(), Context()
    add_vae(oracle, main, vae_px)
    add_vit(oracle, main, vit_px)
    cfg_text = main.copy()  # the context before the prompt text: the image only
    add_text(oracle, main, text(prompt).tolist())
    add_text(oracle, cfg_img, text(prompt).tolist())  # no images
    h, w = vae_px.shape[1] // 8, vae_px.shape[2] // 8
    ref = generate_image(oracle, main, cfg_text, cfg_img, noise(model, 5, h, w), h, w, cfg_text_scale=4.0,
                         cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), renorm_type=renorm,
                         renorm_min=params["cfg_renorm_min"], num_timesteps=7)
    torch.testing.assert_close(latents(out), ref, rtol=0, atol=1e-4)


def test_image_understanding_matches_greedy_oracle(model, oracle, rt):
    img, prompt = image(2, 56, 30), "what is this?"
    (out,) = rt.generate([{"text_ids": [text(prompt)], "images": [img]}], {"target": "text", "max_tokens": 12})
    assert out.finished, out.error
    _, vit_px = preprocess(model, img)
    ctx = Context()
    add_vit(oracle, ctx, vit_px)
    add_text(oracle, ctx, text(prompt).tolist())
    ref = greedy_decode(oracle, ctx, 12)
    assert [int(t) for t in out.tensors("text")] == ref


def _module_counts(rt):
    return {m: sum(c.values()) for m, c in rt.stats()["ranks"][0]["batch_sizes"].items()}


def test_walk_selection_from_runtime_stats(model):
    with Runtime(model) as rt:
        (out,) = rt.generate([{"text_ids": [text("hi")], "images": [image(4)]}], {"target": "text", "max_tokens": 4})
        assert out.finished
        counts = _module_counts(rt)
        # understanding: ViT + LLM only; never the VAE, the flow loop's combine node or the decoder
        assert counts.get("vit_encoder") == 1 and counts.get("LLM", 0) >= 3
        assert not counts.get("vae_encoder") and not counts.get("vae_decoder") and not counts.get("combine_cfg")
    with Runtime(model) as rt:
        (out,) = rt.generate([{"text_ids": [text("a cat")]}], {"target": "image", "height": 16, "width": 16,
                                                               "num_timesteps": 5, "seed": 0})
        assert out.finished
        counts = _module_counts(rt)
        assert not counts.get("vit_encoder") and not counts.get("vae_encoder")
        assert counts["combine_cfg"] == 4 and counts["vae_decoder"] == 1
        (img,) = out.tensors("image_output")
        assert img.dtype == torch.uint8 and img.shape == (16, 16, 3)


class _Probe(CombineCFG):
    """Looks into the LLM engine's cache tables in the middle of the flow loop."""

    def __init__(self, manager_of):
        super().__init__()
        self.manager_of, self.seen = manager_of, []

    def forward(self, graph_walk, engine_inputs, **kw):
        m = self.manager_of()
        rid = engine_inputs.request_ids[0]
        tables = {name: m.block_table(rid, name) for name in m.cache_names(rid)}
        self.seen.append((tables, m.stats()["blocks_used"], {n: m.num_tokens(rid, n) for n in tables}))
        return super().forward(graph_walk, engine_inputs, **kw)


def test_cfg_text_cache_is_a_fork_sharing_the_main_prefix(model):
    holder = {}
    probe = _Probe(lambda: holder["rt"].local_engine("LLM").manager)  # the test looks inside

    class Probed(BagelTiny):
        def build_submodules(self, node_names):
            mods = super().build_submodules(node_names)
            if "combine_cfg" in mods:
                mods["combine_cfg"] = probe
            return mods

    with Runtime(Probed()) as rt:
        holder["rt"] = rt
        big = image(7, 64, 64)  # several 16-token blocks of image context before the prompt
        (out,) = rt.generate([{"text_ids": [text("now make it green please")], "images": [big]}],
                             {"target": "image", "seed": 1, "num_timesteps": 4})
        assert out.finished, out.error
    tables, used, ntok = probe.seen[0]
    main, cfg_text, cfg_img = tables["LLM"], tables["LLM_cfg_text"], tables["LLM_cfg_img"]
    shared = ntok["LLM_cfg_text"] // 16
    assert shared >= 2 and cfg_text[:shared] == main[:shared]  # the same physical blocks, not a copy
    assert set(cfg_text) <= set(main)
    assert used == len(set(main) | set(cfg_text) | set(cfg_img))  # nothing allocated for cfg_text
    assert ntok["LLM_cfg_img"] == len(text("now make it green please")) + 2


def test_batch_invariance_of_generated_latents(model):
    reqs = [({"text_ids": [text("one")]}, 1), ({"text_ids": [text("two things")]}, 2),
            ({"text_ids": [text("three")], "images": [image(9)]}, 3)]
    base = {"target": "image", "num_timesteps": 6, "output_type": "latent"}
    with Runtime(model) as rt:
        alone = [latents(rt.generate([inp], {**base, "seed": s})[0]) for inp, s in reqs]
        handles = [rt.submit(inp, {**base, "seed": s}) for inp, s in reqs]
        together = [latents(h.result()) for h in handles]
    for a, b in zip(alone, together):
        same_bits_or_close(a, b)


def test_cfg_parallel_placement_gives_the_same_image(model):
    inp = {"text_ids": [text("edit me")], "images": [image(11)]}
    params = {"target": "image", "seed": 4, "num_timesteps": 6, "output_type": "latent"}
    with Runtime(model) as rt:
        single = latents(rt.generate([inp], params)[0])
    path = ROOT / "examples" / "placements" / "bagel_cfg_parallel.yaml"
    with Runtime(model, path) as rt:
        (out,) = rt.generate([inp], params)
        assert out.finished, out.error
        ranks = rt.stats()["ranks"]
        assert sum(ranks[1]["batch_sizes"]["LLM"].values()) > 0  # the cfg_text view ran on rank 1
        assert sum(ranks[2]["batch_sizes"]["LLM"].values()) > 0  # the cfg_img view ran on rank 2
    same_bits_or_close(latents(out), single)


@pytest.mark.parametrize("inputs, params, match", [
    ({"text_ids": [text("x")]}, {"target": "video"}, "target"),
    ({"text_ids": [text("x")]}, {"target": "image", "height": 30, "width": 32}, "multiple of 8"),
    ({"text_ids": [text("x")]}, {"target": "image", "height": 512, "width": 32}, r"\[8, 256\]"),
    ({"text_ids": [text("x")]}, {"target": "image", "cfg_interval": [0.5, 0.2]}, "cfg_interval"),
    ({"text_ids": [text("x")]}, {"target": "image", "cfg_renorm_type": "bogus"}, "cfg_renorm_type"),
    ({"text_ids": [text("x")]}, {"target": "image", "num_timesteps": 1}, "num_timesteps"),
    ({"text_ids": [text("x")]}, {"target": "image", "seed": -1}, "seed"),
    ({"text_ids": [torch.tensor([999])]}, {}, "token ids"),
    ({"images": [torch.zeros(4, 4)]}, {}, "uint8"),
    ({}, {}, "neither"),
    ({"text_ids": [text("x")], "images": [image(0)]}, {"order": ["text"]}, "order"),
    ({"text_ids": [text("x")], "images": [image(0)]}, {"target": "image", "height": 64}, "edit keeps"),
    ({"text_ids": [text("x")]}, {"max_tokens": 0}, "max_tokens"),
    ({"prompt": [text("x")]}, {}, "unknown inputs"),
])
def test_bad_requests_are_rejected_with_clear_errors(model, inputs, params, match):
    with pytest.raises(ValueError, match=match):
        model.validate_request(inputs, params)


@dataclasses.dataclass(frozen=True)
class _PoisonedRequest(BagelRequest):
    poison: bool = False


class _Poisoned(BagelTiny):
    """Requests with ``poison`` carry a corrupt layout input into their final walk (a node error)."""

    def parse_request(self, inputs, params):
        poison = bool(params.get("poison"))  # a key this model reads (Runtime.submit refuses keys nothing reads)
        req = super().parse_request(inputs, params)
        return _PoisonedRequest(**{f.name: getattr(req, f.name) for f in dataclasses.fields(req)}, poison=poison)

    def create_state(self, request_id, partition, inputs, request):
        state = super().create_state(request_id, partition, inputs, request)
        if request.poison:
            state.final[1]["ctx"] = [torch.zeros(3, dtype=torch.long)]
        return state


def test_bad_request_fails_alone_and_leaks_nothing():
    with Runtime(_Poisoned()) as rt:
        with pytest.raises(ValueError, match="multiple of 8"):  # rejected at submission
            rt.submit({"text_ids": [text("x")]}, {"target": "image", "height": 7})
        img = {"target": "image", "num_timesteps": 4, "seed": 0, "height": 16, "width": 16}
        good = [rt.submit({"text_ids": [text("fine")]}, img),
                rt.submit({"text_ids": [text("y")], "images": [image(1)]}, {"target": "text", "max_tokens": 3})]
        bad = [rt.submit({"text_ids": [text("x")]}, {**img, "poison": True}),
               rt.submit({"text_ids": [text("z")]}, {"target": "text", "max_tokens": 3, "poison": True})]
        assert all(h.result().finished for h in good)
        for h in bad:
            assert not h.result().finished and "ctx must hold" in h.result().error
        assert rt.stats()["ranks"][0]["kv"]["LLM"]["blocks_used"] == 0


def test_image_output_is_a_decoded_picture(model, rt):
    (out,) = rt.generate([{"text_ids": [text("sky")]}], {"target": "image", "seed": 2, "num_timesteps": 4,
                                                         "height": 24, "width": 40})
    (img,) = out.tensors("image_output")
    assert img.shape == (24, 40, 3) and img.dtype == torch.uint8
    assert np.asarray(img).std() > 0  # not a constant picture


@pytest.mark.slow
def test_cfg_parallel_placement_with_worker_processes(model):
    """Three worker processes: the main cache's pages (and the text-only cache) are copied to the
    guidance ranks for the flow walk; the result equals one rank's."""
    inp = {"text_ids": [text("edit me")], "images": [image(11)]}
    params = {"target": "image", "seed": 4, "num_timesteps": 5, "output_type": "latent"}
    with Runtime(model) as rt:
        single = latents(rt.generate([inp], params)[0])
    path = ROOT / "examples" / "placements" / "bagel_cfg_parallel.yaml"
    with Runtime(model, path, workers="process") as rt:
        (out,) = rt.generate([inp], params)
        assert out.finished, out.error
        ranks = rt.stats()["ranks"]
        assert all(r["kv"]["LLM"]["blocks_used"] == 0 for r in ranks)  # copies dropped, request freed
    torch.testing.assert_close(latents(out), single, rtol=0, atol=1e-5)


def test_kv_pressure_swaps_guidance_caches_out_and_back_exactly(model):
    # a 96-token cache for four guided requests: they wait and swap each other out (forks included)
    reqs = [({"text_ids": [text("one")]}, 1), ({"text_ids": [text("two things")]}, 2),
            ({"text_ids": [text("three")], "images": [image(9)]}, 3),
            ({"text_ids": [text("four and more words")], "images": [image(4)]}, 4)]
    base = {"target": "image", "num_timesteps": 4, "output_type": "latent"}
    with Runtime(model) as rt:
        alone = [latents(rt.generate([inp], {**base, "seed": s})[0]) for inp, s in reqs]
    placement = Placement.single_rank(model.graph, model=model.name).to_dict()
    placement["runtime"].update(kv_cache_blocks=24, kv_block_size=4)
    with Runtime(model, Placement.from_dict(placement)) as rt:
        outs = rt.generate([inp for inp, _ in reqs], [{**base, "seed": s} for _, s in reqs])
        ranks = rt.stats()["ranks"]
        assert ranks[0]["preemptions"]["LLM"] > 0 and ranks[0]["kv"]["LLM"]["blocks_used"] == 0
    for out, a in zip(outs, alone):
        assert out.finished, out.error
        torch.testing.assert_close(latents(out), a, rtol=0, atol=1e-5)
