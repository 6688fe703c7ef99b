"""Qwen3-Omni's preprocessing settings from a checkpoint's ``preprocessor_config.json``: the image
and audio tensors mstar builds equal transformers' processors loaded from the same file, the
defaults hold without one, a bad or mismatched file is refused naming the field, and the code
groups of the graph come from the config."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mstar.model.checkpoint import CheckpointError
from mstar.models.qwen3_omni import graph as omni_graph
from mstar.models.qwen3_omni.config import TINY_HF_CONFIG, Qwen3OmniConfig
from mstar.models.qwen3_omni.encoders import audio_input, image_input
from mstar.models.qwen3_omni.media import PREPROCESSOR_FILE, ImageSettings, MediaSettings
from mstar.models.qwen3_omni.model import Qwen3Omni

transformers = pytest.importorskip("transformers")

# what a released Qwen3-Omni checkpoint's preprocessor_config.json holds: both processors' keys in one
# file, mean = std = 0.5 and a 12.8 MP pixel budget (the image processor's defaults are CLIP's mean /
# std and about 1 MP)
RELEASED = {
    "processor_class": "Qwen3OmniMoeProcessor", "image_processor_type": "Qwen2VLImageProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "min_pixels": 3136, "max_pixels": 12845056,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
    "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True, "padding_side": "right",
}


def _checkpoint(tmp_path, preprocessor=None, config=None):
    (tmp_path / "config.json").write_text(json.dumps(config or TINY_HF_CONFIG))
    if preprocessor is not None:
        (tmp_path / PREPROCESSOR_FILE).write_text(json.dumps(preprocessor))
    return tmp_path


def _reference_image(path, pixels):
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = processor(images=[pixels.numpy()], return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"][0].long()


def test_defaults_without_a_file(tmp_path):
    assert MediaSettings.from_checkpoint(None) == MediaSettings()
    assert MediaSettings.from_checkpoint(_checkpoint(tmp_path)) == MediaSettings()
    assert Qwen3Omni(tmp_path).media.image == ImageSettings()


def test_released_settings_give_transformers_pixels_and_grid(tmp_path):
    """A 1280 x 960 picture: the released file's mean / std and pixel budget give transformers'
    pixel values (bit for bit) and grid [1, 60, 80]; the defaults give another grid and values."""
    path = _checkpoint(tmp_path, RELEASED)
    settings = Qwen3Omni(path).media
    assert settings.image.image_mean == (0.5, 0.5, 0.5) and settings.image.max_pixels == 12845056
    pixels = torch.randint(0, 256, (960, 1280, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ours = image_input(pixels, settings.image)
    want_values, want_grid = _reference_image(path, pixels)
    assert ours.grid_thw.tolist() == want_grid.tolist() == [1, 60, 80]
    assert torch.equal(ours.pixel_values, want_values)
    assert ours.num_tokens == 60 * 80 // 4
    default = image_input(pixels)
    assert default.grid_thw.tolist() == [1, 54, 72]  # the processor's own ~1 MP budget


def test_size_dict_and_pixel_keys_as_transformers_reads_them(tmp_path):
    """transformers 5 saves the budget as ``size``; ``min_pixels`` / ``max_pixels`` override it."""
    pixels = torch.randint(0, 256, (300, 500, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for i, extra in enumerate([{"size": {"shortest_edge": 3136, "longest_edge": 64 * 32 * 32}},
                               {"size": {"shortest_edge": 3136, "longest_edge": 10 ** 7}, "max_pixels": 40000}]):
        folder = tmp_path / str(i)
        folder.mkdir()
        path = _checkpoint(folder, {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
                                    "merge_size": 2, "temporal_patch_size": 2, **extra})
        ours = image_input(pixels, MediaSettings.from_checkpoint(path).image)
        want_values, want_grid = _reference_image(path, pixels)
        assert ours.grid_thw.tolist() == want_grid.tolist() and torch.equal(ours.pixel_values, want_values)
        assert ours.grid_thw.tolist() != image_input(pixels).grid_thw.tolist()  # the budget was read


def test_audio_settings_give_transformers_features(tmp_path):
    """The feature extractor's settings (another FFT size and hop here) reach the features."""
    path = _checkpoint(tmp_path, {**RELEASED, "n_fft": 512, "hop_length": 200, "dither": 0.0})
    settings = MediaSettings.from_checkpoint(path).audio
    assert (settings.n_fft, settings.hop_length) == (512, 200)
    t = torch.arange(24000) / 16000
    wave = (0.3 * torch.sin(2 * math.pi * 440 * t)).float()
    ours = audio_input(wave, 16000, settings=settings)
    fe = transformers.WhisperFeatureExtractor.from_pretrained(path)
    ref = fe(wave.numpy(), sampling_rate=16000, return_attention_mask=True, padding="longest", truncation=False,
             return_tensors="pt")
    frames = int(ref["attention_mask"][0].sum())
    assert torch.equal(ours.features, ref["input_features"][0, :, :frames].float())
    assert ours.features.shape[1] == frames != audio_input(wave, 16000).features.shape[1]


@pytest.mark.parametrize(("bad", "field"), [
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"merge_size": "2"}, "merge_size"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"min_pixels": 10 ** 6, "max_pixels": 10 ** 5}, "min_pixels"),
    ({"size": 448}, "size"),
    ({"hop_length": 0}, "hop_length"),
    ({"dither": "none"}, "dither"),
])
def test_bad_settings_name_the_field(tmp_path, bad, field):
    path = _checkpoint(tmp_path, {**RELEASED, **bad})
    with pytest.raises(CheckpointError, match=field):
        Qwen3Omni(path).preflight()


def test_settings_that_do_not_fit_the_towers_are_refused(tmp_path):
    path = _checkpoint(tmp_path, {**RELEASED, "merge_size": 4, "feature_size": 80})
    with pytest.raises(CheckpointError, match=r"merge_size 4 .*: 2\).*feature_size 80"):
        Qwen3Omni(path).preflight()
    (tmp_path / PREPROCESSOR_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=PREPROCESSOR_FILE):
        Qwen3Omni(path).preflight()


def test_pixel_rows_of_another_patch_size_are_a_clear_error(tmp_path):
    model = Qwen3Omni(_checkpoint(tmp_path))
    ids = torch.tensor([151652, *[151655] * 4, 151653])
    with pytest.raises(ValueError, match=r"pixel_values must be \[patches, 1536\]"):
        model.validate_request({"input_ids": [ids], "pixel_values": [torch.zeros(16, 588)],
                                "image_grid_thw": [torch.tensor([[1, 4, 4]])]}, {})


def _code_group_loop_iters(graph) -> int:
    loops = [s for s in _sections(graph.walks["talker_decode"].section) if getattr(s, "name", None) == "code_groups"]
    assert len(loops) == 1
    return loops[0].max_iters


def _sections(section):
    """A section and every section inside it (composites' parts, loops' bodies)."""
    yield section
    for child in getattr(section, "sections", ()):
        yield from _sections(child)
    body = getattr(section, "section", None)
    if body is not None:
        yield from _sections(body)


def test_code_groups_come_from_the_config():
    """The code predictor's loop runs the config's groups minus the Talker's own code."""
    assert _code_group_loop_iters(omni_graph.build_graph()) == omni_graph.NUM_CODE_GROUPS - 1
    assert _code_group_loop_iters(omni_graph.build_graph(num_code_groups=8)) == 7
    hf = json.loads(json.dumps(TINY_HF_CONFIG))
    hf["talker_config"]["num_code_groups"] = 8
    hf["talker_config"]["code_predictor_config"]["num_code_groups"] = 8
    model = Qwen3Omni(config=Qwen3OmniConfig.from_hf_dict(hf), load_format="dummy")
    assert _code_group_loop_iters(model.build_graph()) == 7
    with pytest.raises(ValueError, match="num_code_groups"):
        omni_graph.build_graph(num_code_groups=1)
