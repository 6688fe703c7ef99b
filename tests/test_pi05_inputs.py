"""pi0.5 input processing against values computed independently here (numpy arithmetic, hand-worked
geometry) and against the reference behaviour the reference notes pin down (``np.digitize`` bins:
0.5 -> 192, not clipped; the exact prompt text; no lower-casing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.models.pi05 import inputs as pi


def test_resize_exact_half_is_the_mean_of_each_2x2_block():
    # bilinear with align_corners=False at an exact factor 2 samples between four pixels
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8, generator=g)
    out = pi.resize_with_pad(img, 4, 4)
    a = img.numpy().astype(np.float64)
    want = (a[0::2, 0::2] + a[1::2, 0::2] + a[0::2, 1::2] + a[1::2, 1::2]) / 4
    assert out.dtype == torch.uint8 and out.shape == (4, 4, 3)
    # uint8 goes through torch's fixed-point uint8 kernel, as in the reference: within one level
    assert np.abs(out.numpy().astype(np.float64) - want).max() <= 1.0
    f = pi.resize_with_pad(img.to(torch.float32) / 255, 4, 4).numpy()
    np.testing.assert_allclose(f, want / 255, atol=1e-6)


RESIZE_FIXTURE = Path(__file__).parent / "fixtures" / "pi05_inputs" / "resize.safetensors"


def test_resize_equals_lerobot_bit_for_bit():
    # written by lerobot 0.6.1's resize_with_pad_torch (tests/fixtures/pi05_inputs/make_fixture.py)
    from safetensors.torch import load_file

    fx = load_file(str(RESIZE_FIXTURE))
    cases = sorted({k.rsplit(".", 1)[0] for k in fx})
    assert len(cases) == 7
    for case in cases:
        img, want = fx[f"{case}.in"], fx[f"{case}.out"]
        side = 56 if case.startswith("uint8") else 24
        got = pi.resize_with_pad(img, side, side)
        assert got.dtype == want.dtype and torch.equal(got, want), case


def test_resize_keeps_aspect_and_pads_centred_with_black():
    img = torch.full((20, 40, 3), 200, dtype=torch.uint8)  # wide: scaled to 28 x 56, 14 rows each side
    out = pi.resize_with_pad(img, 56, 56).numpy()
    assert out.shape == (56, 56, 3)
    assert (out[:14] == 0).all() and (out[42:] == 0).all()
    assert (out[14:42] == 200).all()


def test_resize_odd_padding_goes_to_the_bottom():
    img = torch.full((11, 56, 3), 7, dtype=torch.uint8)  # 45 rows of padding: 22 above, 23 below
    out = pi.resize_with_pad(img, 56, 56).numpy()
    assert (out[:22] == 0).all() and (out[22:33] == 7).all() and (out[33:] == 0).all()


def test_resize_same_size_is_unchanged_and_float_stays_float():
    img = torch.rand(56, 56, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(pi.resize_with_pad(img, 56, 56), img)
    out = pi.resize_with_pad(torch.full((28, 56, 3), 0.25), 56, 56)
    assert out.dtype == torch.float32 and float(out[0, 0, 0]) == 0.0 and float(out[28, 28, 1]) == 0.25


def test_image_to_model_scales_to_minus_one_one_channels_first():
    img = torch.zeros(28, 56, 3, dtype=torch.uint8)
    img[:, :, 0], img[:, :, 1], img[:, :, 2] = 0, 255, 51
    x = pi.image_to_model(img, 56, 56)
    assert x.shape == (3, 56, 56) and x.dtype == torch.float32
    assert float(x[0, 20, 5]) == -1.0 and float(x[1, 20, 5]) == 1.0
    assert abs(float(x[2, 20, 5]) - (51 / 255 * 2 - 1)) < 1e-7
    assert (x[:, :14] == -1.0).all()  # black padding is -1 for SigLIP


def test_prepare_cameras_masks_missing_slots():
    cams = {"base_0_rgb": torch.full((56, 56, 3), 255, dtype=torch.uint8),
            "right_wrist_0_rgb": torch.zeros(56, 56, 3, dtype=torch.uint8)}
    out = pi.prepare_cameras(cams, 56, 56)
    assert out.images.shape == (3, 3, 56, 56)
    assert out.mask.tolist() == [True, False, True]
    assert (out.images[0] == 1).all() and (out.images[1] == -1).all() and (out.images[2] == -1).all()


@pytest.mark.parametrize("cams, match", [
    ({}, "at least one camera"),
    ({"front": torch.zeros(4, 4, 3, dtype=torch.uint8)}, "unknown camera"),
    ({"base_0_rgb": torch.zeros(3, 4, 4, dtype=torch.uint8)}, r"\[H, W, 3\]"),
    ({"base_0_rgb": torch.full((4, 4, 3), 2.0)}, r"in \[0, 1\]"),
    ({"base_0_rgb": torch.full((4, 4, 3), float("nan"))}, "finite"),
    ({"base_0_rgb": torch.zeros(4, 4, 3, dtype=torch.int32)}, "uint8 or float"),
])
def test_prepare_cameras_rejects_bad_images(cams, match):
    with pytest.raises(ValueError, match=match):
        pi.prepare_cameras(cams, 56, 56)


def test_discretize_matches_the_reference_points():
    x = np.array([0.5, -1.0, 0.0, -1.0001, 1 - 1 / 128, 0.999, 1.0, 1.5, -0.9999])
    assert pi.discretize_state(x).tolist() == [192, 0, 128, -1, 255, 255, 255, 255, 0]
    # upstream's round(clip(x) * 255) would give 191 at 0.5: the bins are floor((x + 1) * 128)
    assert int(round(0.5 * 255)) != int(pi.discretize_state(np.array([0.5]))[0])


def test_discretize_equals_floor_formula_inside_the_range():
    x = np.random.default_rng(0).uniform(-0.999, 0.999, size=1000)
    assert np.array_equal(pi.discretize_state(x), np.floor((x + 1) * 128).astype(np.int64))


def test_state_prompt_text_is_exact_and_keeps_case():
    s = pi.state_prompt("  Pick_up the\nRed Cube ", np.array([0.5, 0.0, -1.0]))
    assert s == "Task: Pick up the Red Cube, State: 192 128 0;\nAction: "


@pytest.mark.parametrize("bad, match", [
    (np.array([1.0, np.nan]), "finite"), (np.array([[1.0]]), "1-D"), (np.array([]), "non-empty"),
    (np.array(["a"]), "numeric"),
])
def test_check_state_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        pi.check_state(bad)


def test_quantile_stats_lerobot_formula_and_passthrough():
    st = pi.QuantileStats(q01=np.array([0.0, -2.0, 3.0]), q99=np.array([2.0, 2.0, 3.0]))
    x = np.array([[1.0, 1.0, 3.0, 9.0]], dtype=np.float32)  # last dim has no stats
    n = st.normalize(x)
    want = [2 * (1 - 0) / 2 - 1, 2 * (1 + 2) / 4 - 1, 2 * 0 / 1e-8 - 1, 9.0]
    np.testing.assert_allclose(n[0], want, rtol=1e-6)
    np.testing.assert_allclose(st.unnormalize(n), x, rtol=1e-6, atol=1e-6)
    a = np.array([-1.0, 0.0, 1.0, 0.5], dtype=np.float32)
    np.testing.assert_allclose(st.unnormalize(a), [0.0, 0.0, 3.0, 0.5], atol=1e-6)


def test_quantile_stats_openpi_eps():
    # a narrow range shows the 1e-6 openpi adds to every denominator (lerobot adds none here)
    q01, q99 = np.array([0.0]), np.array([1e-5])
    x = np.array([5e-6])
    openpi = pi.QuantileStats(q01=q01, q99=q99, openpi_eps=True).normalize(x)
    np.testing.assert_allclose(openpi, [5e-6 / 1.1e-5 * 2 - 1], rtol=1e-4)
    np.testing.assert_allclose(pi.QuantileStats(q01=q01, q99=q99).normalize(x), [0.0], atol=1e-5)


def test_quantile_stats_reject_mismatched():
    with pytest.raises(ValueError, match="one length"):
        pi.QuantileStats(q01=np.zeros(2), q99=np.zeros(3))


def test_load_norm_stats_lerobot_safetensors(tmp_path):
    from safetensors.numpy import save_file

    save_file({"observation.state.q01": np.array([-1.0, 0.0], np.float32),
               "observation.state.q99": np.array([1.0, 4.0], np.float32),
               "observation.state.mean": np.zeros(2, np.float32)},
              str(tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    save_file({"action.q01": np.array([0.0], np.float32), "action.q99": np.array([10.0], np.float32)},
              str(tmp_path / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    stats = pi.load_norm_stats(tmp_path)
    assert stats.state.q99.tolist() == [1.0, 4.0] and not stats.state.openpi_eps
    np.testing.assert_allclose(stats.actions.unnormalize(np.array([0.0])), [5.0])


def test_load_norm_stats_openpi_json(tmp_path):
    (tmp_path / "assets" / "droid").mkdir(parents=True)
    body = {"norm_stats": {"state": {"mean": [0], "std": [1], "q01": [0.0], "q99": [2.0]},
                           "actions": {"mean": [0], "std": [1], "q01": [-1.0], "q99": [1.0]}}}
    (tmp_path / "assets" / "droid" / "norm_stats.json").write_text(json.dumps(body))
    stats = pi.load_norm_stats(tmp_path)
    assert stats.state.openpi_eps and stats.actions.q01.tolist() == [-1.0]
    assert pi.load_norm_stats(tmp_path / "assets") == pi.NormStats()
    assert pi.load_norm_stats(None) == pi.NormStats()


def test_prompt_tokens_checks_and_truncates():
    t = pi.prompt_tokens(list(range(1, 300)), vocab_size=1024)
    assert t.ids.shape == (pi.MAX_PROMPT_TOKENS,) and t.ids[0] == 1 and bool(t.mask.all())
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        pi.prompt_tokens([2, 1024], vocab_size=1024)
    with pytest.raises(ValueError, match="integer"):
        pi.prompt_tokens(torch.tensor([1.0, 2.0]), vocab_size=1024)
    with pytest.raises(ValueError, match="non-empty"):
        pi.prompt_tokens([], vocab_size=1024)


def test_tokenizer_from_checkpoint_dir_puts_bos_first(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["Task: pick up the cube, State: 1 2 3;", "Action: move left",
                                 "Task: open the drawer, State: 10 20;"] * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "paligemma_tokenizer"),
                                   vocab_size=40, model_type="bpe", bos_id=2, eos_id=1, pad_id=0, unk_id=3,
                                   minloglevel=2)
    tok = pi.PromptTokenizer.find(tmp_path)
    assert tok is not None and pi.PromptTokenizer.find(tmp_path / "nothing") is None
    text = pi.state_prompt("pick up the cube", np.array([0.5]))
    ids = tok.encode(text)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "paligemma_tokenizer.model"))
    assert ids[0] == pi.BOS_ID and ids[1:] == sp.encode(text) and len(ids) > 5


def test_checkpoint_image_resolution_gives_lerobots_pixels(tmp_path):
    """A checkpoint whose config.json asks for 56 x 56 cameras (not the released 224): the adapter's
    request holds lerobot's resize_with_pad output at that size, scaled to [-1, 1] as its policy
    does; a missing camera is all -1 and masked out."""
    from safetensors.torch import load_file

    from mstar.models.pi05.adapter import Pi05Adapter
    from mstar.models.pi05.model import Pi05Model

    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05", "image_resolution": [56, 56]}))
    model = Pi05Model(model_path=tmp_path, load_format="dummy")
    assert model.config.vision.image_size == 56
    fx = load_file(str(RESIZE_FIXTURE))
    req = Pi05Adapter(model).request(pi.Observation(cameras={"base_0_rgb": fx["uint8.0.in"],
                                                             "right_wrist_0_rgb": fx["uint8.3.in"]},
                                                    token_ids=torch.tensor([2, 5, 7])))
    images, mask = req.inputs["images"][0], req.inputs["image_masks"][0]
    assert images.shape == (3, 3, 56, 56) and mask.tolist() == [True, False, True]

    def scaled(name):
        return (fx[name].to(torch.float32) / 255.0 * 2.0 - 1.0).permute(2, 0, 1)

    assert torch.equal(images[0], scaled("uint8.0.out"))
    assert torch.equal(images[2], scaled("uint8.3.out"))
    assert torch.equal(images[1], torch.full((3, 56, 56), -1.0))
