"""BAGEL from a checkpoint directory in the released layout (llm_config.json, vit_config.json,
ema.safetensors, ae.safetensors, tokenizer.json). The files are written here from tiny reference
models -- transformers' SiglipVisionModel, diffusers' AutoencoderKL, a seeded MoT LLM -- and a
``tokenizers`` tokenizer, then read back through ``BagelModel(model_path=...)``: every weight, the
ViT and VAE outputs against their references, the special token ids, errors that name the file or
key, and a short run through the runtime."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from safetensors.torch import load_file, save_file
from transformers import SiglipVisionConfig, SiglipVisionModel

from mstar import Runtime
from mstar.models.bagel.config import TINY_SPEC
from mstar.models.bagel.loader import CheckpointError, vae_config_from_file
from mstar.models.bagel.model import BagelModel
from mstar.models.bagel.nodes import BagelLLMNode, SpecialTokens
from mstar.models.bagel.vae import FLUX, BagelVAEConfig, bfl_key_map

ATOL = 1e-5
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]

# Qwen2-style, as the released llm_config.json (no head_dim: hidden_size / num_attention_heads).
LLM_JSON = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# SigLIP at 980 px / patch 14: the loader fixes 70 patches per side, so only the widths are tiny.
# BAGEL runs all layers but the last: 3 in the file, 2 built.
VIT_JSON = {
    "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_channels": 3, "image_size": 980, "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "attention_dropout": 0.0,
}
VAE_CHANNELS, VAE_LAYERS, LATENT_CHANNELS = (32, 64), 1, 4
SCALE, SHIFT = 0.3611, 0.1159  # the FLUX autoencoder's latent scaling, which BAGEL keeps


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if re.search(r"norm", name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _siglip_reference() -> torch.nn.Module:
    cfg = SiglipVisionConfig(**{k: v for k, v in VIT_JSON.items() if k != "model_type"}, vision_use_head=False,
                             attn_implementation="eager")
    cfg.num_hidden_layers = VIT_JSON["num_hidden_layers"] - 1
    ref = SiglipVisionModel(cfg).eval()
    _randomize(ref, 1)
    return getattr(ref, "vision_model", ref)  # transformers 4.x nests the transformer, 5.x does not


def _vae_reference() -> AutoencoderKL:
    n = len(VAE_CHANNELS)
    ref = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=VAE_CHANNELS,
                        layers_per_block=VAE_LAYERS, latent_channels=LATENT_CHANNELS, norm_num_groups=32,
                        act_fn="silu", use_quant_conv=False, use_post_quant_conv=False).eval()
    _randomize(ref, 2)
    return ref


def _to_bfl(ref: AutoencoderKL) -> dict[str, torch.Tensor]:
    """diffusers names -> BFL names (the inverse of the key map, itself checked against diffusers'
    LDM converter); the attention projections become 1x1 convs, as BFL stores them."""
    cfg = BagelVAEConfig(block_out_channels=VAE_CHANNELS, layers_per_block=VAE_LAYERS, latent_channels=LATENT_CHANNELS)
    to_bfl = {dif: bfl for bfl, dif in bfl_key_map(cfg).items()}
    out = {}
    for k, v in ref.state_dict().items():
        if ".attentions.0.to_" in k and k.endswith(".weight"):
            v = v[:, :, None, None]
        out[to_bfl[k]] = v.clone().contiguous()
    return out


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "a", "red", "cube", "on", "the", "table", "what", "is", "this", "?"]
    words += [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("bagel_ckpt")
    (root / "llm_config.json").write_text(json.dumps(LLM_JSON))
    (root / "vit_config.json").write_text(json.dumps(VIT_JSON))
    _tokenizer_json(root / "tokenizer.json")

    siglip = _siglip_reference()
    ema = {}
    for k, v in siglip.state_dict().items():
        if "position_ids" in k:
            continue
        if k == "embeddings.patch_embedding.weight":  # conv [out, C, p, p] -> linear over (p_row, p_col, c)
            v = v.permute(0, 2, 3, 1).reshape(v.shape[0], -1)
        ema[f"vit_model.vision_model.{k}"] = v.clone().contiguous()
    g = torch.Generator().manual_seed(3)
    hidden, vit_hidden = LLM_JSON["hidden_size"], VIT_JSON["hidden_size"]
    ema["connector.fc1.weight"] = 0.1 * torch.randn(hidden, vit_hidden, generator=g)
    ema["connector.fc1.bias"] = 0.1 * torch.randn(hidden, generator=g)
    ema["connector.fc2.weight"] = 0.1 * torch.randn(hidden, hidden, generator=g)
    ema["connector.fc2.bias"] = 0.1 * torch.randn(hidden, generator=g)
    ema["vit_pos_embed.pos_embed"] = torch.randn(70 * 70, hidden, generator=g)

    # No library holds the MoT LLM: a seeded node built on its own, saved under the checkpoint names.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        llm = BagelLLMNode(TINY_SPEC.llm, 4 * LATENT_CHANNELS, 64, SpecialTokens(0, 1, 2, 3))
    _randomize(llm, 4)
    llm_state = {k: v.clone().contiguous() for k, v in llm.state_dict().items()}
    assert {k.split(".")[0] for k in llm_state} == {"language_model", "time_embedder", "vae2llm", "llm2vae",
                                                    "latent_pos_embed"}
    ema.update(llm_state)
    save_file(ema, str(root / "ema.safetensors"))

    vae = _vae_reference()
    save_file(_to_bfl(vae), str(root / "ae.safetensors"))
    return SimpleNamespace(dir=root, ema=ema, siglip=siglip, vae=vae)


@pytest.fixture(scope="module")
def loaded(ckpt):
    model = BagelModel(model_path=ckpt.dir)
    parts = model.build_submodules(["LLM", "vit_encoder", "vae_encoder", "vae_decoder"])
    return model, parts


# ----------------------------------------------------------------------------------------------
# configs, weights, outputs
# ----------------------------------------------------------------------------------------------


def test_spec_is_read_from_the_files(loaded):
    model, _ = loaded
    spec = model.spec
    assert spec.llm == TINY_SPEC.llm  # head_dim derived as hidden_size / num_attention_heads
    assert spec.vit.num_hidden_layers == VIT_JSON["num_hidden_layers"] - 1
    assert (spec.vit.hidden_size, spec.vit.patch_size, spec.vit.vit_max_num_patch_per_side) == (32, 14, 70)
    assert spec.vit.llm_hidden == LLM_JSON["hidden_size"]
    assert spec.vae == BagelVAEConfig(block_out_channels=VAE_CHANNELS, layers_per_block=VAE_LAYERS,
                                      latent_channels=LATENT_CHANNELS, norm_num_groups=32)
    assert spec.latent_dim == 4 * LATENT_CHANNELS and spec.latent_downsample == 4


def test_image_transforms_are_sized_from_the_files(loaded):
    """The transforms follow the checkpoint's geometry, not the released model's constants: this
    autoencoder's 2 px cells x latent patch 2 give 4 px latent cells, so images are cut to multiples
    of 4 and at most 64 cells (256 px) a side, the latent position table's size (the released
    1024 px would index past it); the ViT's follow vit_config.json (980 px at patch 14)."""
    from PIL import Image

    from mstar.models.bagel.config import ImageTransformSpec

    model, _ = loaded
    spec = model.spec
    assert spec.vae_transform == ImageTransformSpec(256, 128, 4)
    assert spec.vit_transform == ImageTransformSpec(980, 224, 14)
    assert spec.default_size == (256, 256)
    vae_resize, vit_resize = model.vae_resize, model.vit_resize
    w, h = vae_resize.resize(Image.new("RGB", (2000, 1000))).size
    assert w % 4 == h % 4 == 0 and max(w, h) <= 256
    w, h = vit_resize.resize(Image.new("RGB", (2000, 1000))).size
    assert w % 14 == h % 14 == 0 and max(w, h) <= 980


def test_vae_geometry_of_a_flux_sized_file(tmp_path):
    """Only the header counts: int8 tensors with the FLUX autoencoder's shapes give exactly ``FLUX``."""
    def w(o, i, k=3):
        return torch.zeros(o, i, k, k, dtype=torch.int8)

    shapes = {"encoder.conv_in.weight": w(128, 3), "encoder.down.0.block.0.conv1.weight": w(128, 128),
              "encoder.down.0.block.1.conv1.weight": w(128, 128), "encoder.down.1.block.0.conv1.weight": w(256, 128),
              "encoder.down.2.block.0.conv1.weight": w(512, 256), "encoder.down.3.block.0.conv1.weight": w(512, 512),
              "decoder.conv_in.weight": w(512, 16), "decoder.conv_out.weight": w(3, 128)}
    save_file(shapes, str(tmp_path / "ae.safetensors"))
    assert vae_config_from_file(tmp_path / "ae.safetensors") == FLUX
    del shapes["encoder.down.1.block.0.conv1.weight"]  # a gap in the levels
    save_file(shapes, str(tmp_path / "ae.safetensors"))
    with pytest.raises(CheckpointError, match=r"ae\.safetensors.*found levels \[0, 2, 3\]"):
        vae_config_from_file(tmp_path / "ae.safetensors")


def test_every_weight_equals_the_saved_tensors(ckpt, loaded):
    _, parts = loaded
    llm, vit, vae = parts["LLM"], parts["vit_encoder"].vit, parts["vae_decoder"].vae
    assert parts["vae_encoder"].vae is vae  # one autoencoder for both nodes
    llm_state, vit_state = llm.state_dict(), vit.state_dict()
    assert set(llm_state) | set(vit_state) == set(ckpt.ema) and not set(llm_state) & set(vit_state)
    for k, v in {**llm_state, **vit_state}.items():
        assert v.dtype == torch.float32 and torch.equal(v, ckpt.ema[k]), k
    ref = ckpt.vae.state_dict()
    ours = vae.model.state_dict()
    assert set(ours) == set(ref)
    for k, v in ours.items():
        assert torch.equal(v, ref[k]), k


def test_special_tokens_come_from_tokenizer_json(ckpt, loaded):
    from tokenizers import Tokenizer

    model, parts = loaded
    tok = Tokenizer.from_file(str(ckpt.dir / "tokenizer.json"))
    expected = tuple(tok.token_to_id(t) for t in SPECIALS)
    assert expected == (211, 212, 213, 214)  # not the byte tokenizer's 259..262
    assert model.special_tokens.as_tuple() == expected
    assert parts["LLM"].tokens.as_tuple() == expected
    assert model.tokenizer.eos_token_ids == (expected[1],)
    assert model.tokenizer.encode("a red cube", add_special_tokens=False) == [1, 2, 3]


def test_vit_full_size_image_matches_siglip(ckpt, loaded):
    _, parts = loaded
    vit = parts["vit_encoder"].vit
    g = torch.Generator().manual_seed(5)
    image = torch.rand(3, 980, 980, generator=g) * 2 - 1
    with torch.no_grad():
        expected = ckpt.siglip(pixel_values=image[None]).last_hidden_state[0]
        feats = vit.encode([image])[0]
        out = vit([image])[0]
    assert feats.shape == (70 * 70, 32)
    torch.testing.assert_close(feats, expected, atol=ATOL, rtol=0)
    # the connector and vit_pos_embed of the file on top (a full-size image reads every table row)
    e = ckpt.ema
    h = F.gelu(expected @ e["connector.fc1.weight"].T + e["connector.fc1.bias"], approximate="tanh")
    ref = h @ e["connector.fc2.weight"].T + e["connector.fc2.bias"] + e["vit_pos_embed.pos_embed"]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_vae_matches_diffusers(ckpt, loaded):
    _, parts = loaded
    vae = parts["vae_decoder"].vae
    g = torch.Generator().manual_seed(6)
    z = torch.randn(2, LATENT_CHANNELS, 6, 4, generator=g)
    images = torch.rand(1, 3, 16, 24, generator=g) * 2 - 1
    with torch.no_grad():
        expected = ckpt.vae.decode(z / SCALE + SHIFT).sample
        got = vae.decode(z)
        mean = ckpt.vae.encode(images).latent_dist.mean
        latents = vae.encode(images)
    assert got.shape == (2, 3, 12, 8)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(latents, SCALE * (mean - SHIFT), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def _edit(path: Path, fn) -> None:
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def _drop(key):
    return lambda state: state.pop(key)


def _reshape(key, shape):
    return lambda state: state.__setitem__(key, torch.zeros(shape))


@pytest.mark.parametrize("nodes, change, match", [
    (["LLM"], ("rm", "ema.safetensors"), r"missing ema\.safetensors"),
    (["vit_encoder"], ("rm", "ema.safetensors"), r"missing ema\.safetensors"),
    (["LLM"], ("rm", "llm_config.json"), r"missing llm_config\.json"),
    (["vit_encoder"], ("rm", "vit_config.json"), r"missing vit_config\.json"),
    (["LLM"], ("ema.safetensors", _drop("language_model.model.layers.1.mlp_moe_gen.down_proj.weight")),
     r"ema\.safetensors \(LLM\).*missing: language_model\.model\.layers\.1\.mlp_moe_gen\.down_proj\.weight"),
    (["vit_encoder"], ("ema.safetensors", _reshape("connector.fc1.weight", (64, 31))),
     r"ema\.safetensors \(ViT\).*shape mismatch: connector\.fc1\.weight \(checkpoint \(64, 31\), model \(64, 32\)\)"),
    (["LLM"], ("ema.safetensors", _reshape("vae2llm.weight", (64, 8))),
     r"ema\.safetensors \(LLM\).*shape mismatch: vae2llm\.weight"),
    (["vae_decoder"], ("ae.safetensors", _drop("decoder.mid.attn_1.q.weight")),
     r"ae\.safetensors.*missing key\(s\): decoder\.mid\.attn_1\.q\.weight"),
    (["vae_decoder"], ("ae.safetensors", _reshape("encoder.norm_out.weight", (63,))),
     r"(?s)ae\.safetensors.*size mismatch for encoder\.conv_norm_out\.weight"),
    (["vae_decoder"], ("rm", "ae.safetensors"), r"missing ae\.safetensors"),
])
def test_bad_checkpoint_names_the_file_or_key(ckpt, tmp_path, nodes, change, match):
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt.dir, root)
    what, how = change
    if what == "rm":
        (root / how).unlink()
    else:
        _edit(root / what, how)
    with pytest.raises(CheckpointError, match=match):
        BagelModel(model_path=root).build_submodules(nodes)


def test_a_missing_model_path_or_config_key(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        BagelModel(model_path=tmp_path / "nowhere").build_submodules(["LLM"])
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt.dir, root)
    (root / "llm_config.json").write_text(json.dumps({k: v for k, v in LLM_JSON.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="llm_config.json lacks 'hidden_size'"):
        BagelModel(model_path=root).build_submodules(["LLM"])


# ----------------------------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------------------------


def test_runtime_generates_from_the_checkpoint(ckpt):
    model = BagelModel(model_path=ckpt.dir)
    ids = torch.tensor(model.tokenizer.encode("a red cube on the table", add_special_tokens=False))
    question = torch.tensor(model.tokenizer.encode("what is this ?", add_special_tokens=False))
    g = torch.Generator().manual_seed(7)
    picture = torch.randint(0, 256, (40, 52, 3), generator=g, dtype=torch.uint8)
    with Runtime(model) as rt:
        (img,) = rt.generate([{"text_ids": [ids]}], {"target": "image", "height": 16, "width": 16,
                                                     "num_timesteps": 3, "seed": 0})
        (lat,) = rt.generate([{"text_ids": [ids]}], {"target": "image", "height": 16, "width": 16,
                                                     "num_timesteps": 3, "seed": 0, "output_type": "latent"})
        (txt,) = rt.generate([{"text_ids": [question], "images": [picture]}], {"target": "text", "max_tokens": 4})
    for out in (img, lat, txt):
        assert out.finished, out.error
    (pixels,) = img.tensors("image_output")
    assert pixels.dtype == torch.uint8 and pixels.shape == (16, 16, 3)
    (latents,) = lat.tensors("image_output")
    assert latents.shape == (4 * 4, 4 * LATENT_CHANNELS) and torch.isfinite(latents).all()
    tokens = [int(t) for t in txt.tensors("text")]
    assert 1 <= len(tokens) <= 4 and all(0 <= t < LLM_JSON["vocab_size"] for t in tokens)
