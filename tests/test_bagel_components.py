"""BAGEL's stateless components: ViT vs transformers' SiglipVisionModel, VAE vs diffusers' AutoencoderKL
(BFL names checked against diffusers' own LDM converter), sin-cos tables, timestep embedding, patch
helpers and the image transform's size rule."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image
from safetensors.torch import save_file
from transformers import SiglipVisionModel

from mstar.models.bagel import vae as vae_mod
from mstar.models.bagel import vit as vit_mod
from mstar.models.bagel.embeddings import (
    PositionEmbedding,
    TimestepEmbedder,
    flattened_position_ids,
    patchify,
    sincos_2d,
    unpatchify,
)
from mstar.models.bagel.image_transform import BagelImageTransform, to_pil
from mstar.models.bagel.vae import (
    BagelVAE,
    bfl_key_map,
    convert_bfl_state_dict,
    patchify_latents,
    unpatchify_latents,
)
from mstar.models.bagel.vit import BagelViT, conv_patch_weight_to_linear

ATOL = 1e-5


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if re.search(r"norm|layernorm", name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


# ----------------------------------------------------------------------------------------------
# ViT
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vit_pair():
    """A stock SiglipVisionModel (conv patch embedding) and a BagelViT holding the same weights."""
    torch.manual_seed(0)
    cfg = vit_mod.TINY
    ref = SiglipVisionModel(cfg.siglip_config()).eval()
    _randomize(ref, 1)
    ref_tf = getattr(ref, "vision_model", ref)  # transformers 4.x nests, 5.x does not
    ours = BagelViT(cfg).eval()
    _randomize(ours, 2)  # connector (and anything not copied below) gets its own values
    ours.vit_pos_embed.reset_table()  # a fixed table, not a trained weight
    state = {k: v.clone() for k, v in ref_tf.state_dict().items()}
    state["embeddings.patch_embedding.weight"] = conv_patch_weight_to_linear(
        state["embeddings.patch_embedding.weight"])
    missing, unexpected = ours.vit_model.vision_model.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    return cfg, ref_tf, ours


def test_vit_checkpoint_names(vit_pair):
    _, _, ours = vit_pair
    names = set(ours.state_dict())
    assert "vit_model.vision_model.embeddings.patch_embedding.weight" in names
    assert "vit_model.vision_model.encoder.layers.1.mlp.fc2.bias" in names
    assert "vit_model.vision_model.post_layernorm.weight" in names
    assert {"connector.fc1.weight", "connector.fc2.bias", "vit_pos_embed.pos_embed"} <= names
    assert not any(".head." in n for n in names)
    assert ours.vit_model.vision_model.embeddings.patch_embedding.weight.shape == (32, 14 * 14 * 3)
    assert len(ours.vit_model.vision_model.encoder.layers) == 2


def test_vit_full_size_image_matches_siglip(vit_pair):
    cfg, ref, ours = vit_pair
    g = torch.Generator().manual_seed(3)
    image = torch.rand(3, cfg.image_size, cfg.image_size, generator=g) * 2 - 1
    ids = flattened_position_ids(cfg.image_size, cfg.image_size, cfg.patch_size, cfg.vit_max_num_patch_per_side)
    assert torch.equal(ids, torch.arange(64))
    with torch.no_grad():
        expected = ref(pixel_values=image[None]).last_hidden_state[0]
        got = ours.encode([image])[0]
    assert got.shape == (64, cfg.hidden_size)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _siglip_by_hand(ref, image: torch.Tensor, cfg) -> torch.Tensor:
    """Stock modules, conv patch embedding, position rows picked by (row, col) on the max-size grid."""
    p, m = cfg.patch_size, cfg.vit_max_num_patch_per_side
    nh, nw = image.shape[1] // p, image.shape[2] // p
    patches = ref.embeddings.patch_embedding(image[None])  # [1, D, nh, nw]
    patches = patches.flatten(2).transpose(1, 2)  # row-major
    rows = torch.tensor([r * m + c for r in range(nh) for c in range(nw)])
    x = patches + ref.embeddings.position_embedding.weight[rows][None]
    x = ref.encoder(inputs_embeds=x).last_hidden_state
    return ref.post_layernorm(x)[0]


def test_vit_non_square_image_and_batching(vit_pair):
    cfg, ref, ours = vit_pair
    g = torch.Generator().manual_seed(4)
    a = torch.rand(3, 28, 56, generator=g) * 2 - 1  # 2 x 4 patches
    b = torch.rand(3, 28, 56, generator=g) * 2 - 1
    c = torch.rand(3, 84, 42, generator=g) * 2 - 1  # 6 x 3 patches
    with torch.no_grad():
        feats = ours.encode([a, c, b])
        singles = [ours.encode([x])[0] for x in (a, c, b)]
        for x, f in zip((a, c, b), feats):
            torch.testing.assert_close(f, _siglip_by_hand(ref, x, cfg), atol=ATOL, rtol=0)
        for f, s in zip(feats, singles):
            torch.testing.assert_close(f, s, atol=ATOL, rtol=0)
        out = ours([a, c])
    assert [o.shape for o in out] == [(8, cfg.llm_hidden), (18, cfg.llm_hidden)]
    # connector (gelu tanh) + fixed vit_pos_embed rows of the (row, col) ids
    table = torch.from_numpy(_numpy_sincos_2d(cfg.llm_hidden, cfg.vit_max_num_patch_per_side)).float()
    fc1, fc2 = ours.connector.fc1, ours.connector.fc2
    for x, f, o in zip((a, c), feats, out):
        ids = flattened_position_ids(x.shape[1], x.shape[2], 14, cfg.vit_max_num_patch_per_side)
        h = fc1(f)
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        torch.testing.assert_close(o, fc2(h) + table[ids], atol=ATOL, rtol=0)


def test_vit_rejects_bad_sizes(vit_pair):
    _, _, ours = vit_pair
    with pytest.raises(ValueError, match="multiple of the patch size"):
        ours([torch.zeros(3, 20, 28)])
    with pytest.raises(ValueError, match="exceeds the position table"):
        ours([torch.zeros(3, 14 * 9, 14)])


def test_vit_config_from_json():
    raw = {"hidden_size": 1152, "image_size": 980, "intermediate_size": 4304, "model_type": "siglip_vision_model",
           "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14}
    assert vit_mod.BagelViTConfig.from_json(raw) == vit_mod.BAGEL_7B_MOT_VIT
    with pytest.raises(ValueError, match="vit_max_num_patch_per_side"):
        vit_mod.BagelViTConfig.from_json(raw, vit_max_num_patch_per_side=64)


# ----------------------------------------------------------------------------------------------
# VAE
# ----------------------------------------------------------------------------------------------


def _diffusers_to_bfl(name: str, num_levels: int) -> str:
    """The test's own inverse naming (diffusers -> BFL), written independently of ``bfl_key_map``."""
    side, rest = name.split(".", 1)
    m = re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)
    if m:
        rest = f"down.{m[1]}.block.{m[2]}.{m[3]}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.(.+)", rest)
    if m:
        rest = f"down.{m[1]}.downsample.{m[2]}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)
    if m:
        rest = f"up.{num_levels - 1 - int(m[1])}.block.{m[2]}.{m[3]}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest)
    if m:
        rest = f"up.{num_levels - 1 - int(m[1])}.upsample.{m[2]}"
    m = re.fullmatch(r"mid_block\.resnets\.(\d)\.(.+)", rest)
    if m:
        rest = f"mid.block_{int(m[1]) + 1}.{m[2]}"
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)\.(weight|bias)", rest)
    if m:
        rest = f"mid.attn_1.{attn[m[1]]}.{m[2]}"
    rest = rest.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
    return f"{side}.{rest}"


@pytest.fixture(scope="module")
def vae_ref():
    cfg = vae_mod.TINY
    ref = AutoencoderKL(**cfg.diffusers_kwargs()).eval()
    _randomize(ref, 5)
    bfl = {}
    for k, v in ref.state_dict().items():
        if ".attentions.0.to_" in k and k.endswith("weight"):
            v = v[:, :, None, None]  # BFL stores the attention projections as 1x1 convs
        bfl[_diffusers_to_bfl(k, cfg.num_levels)] = v.clone().contiguous()
    return cfg, ref, bfl


def test_vae_key_map_matches_diffusers_modules():
    for cfg in (vae_mod.TINY, vae_mod.FLUX):
        expected = set(BagelVAE(cfg, device="meta").model.state_dict())
        assert set(bfl_key_map(cfg).values()) == expected
    flux = bfl_key_map(vae_mod.FLUX)
    assert flux["decoder.up.0.block.0.nin_shortcut.weight"] == "decoder.up_blocks.3.resnets.0.conv_shortcut.weight"
    assert "decoder.up.0.block.1.nin_shortcut.weight" not in flux
    assert flux["decoder.up.3.upsample.conv.bias"] == "decoder.up_blocks.0.upsamplers.0.conv.bias"
    assert flux["encoder.mid.attn_1.proj_out.weight"] == "encoder.mid_block.attentions.0.to_out.0.weight"
    assert "decoder.up.0.upsample.conv.weight" not in flux and "encoder.down.3.downsample.conv.weight" not in flux


def test_vae_convert_agrees_with_diffusers_ldm_converter(vae_ref):
    single_file = pytest.importorskip("diffusers.loaders.single_file_utils")
    cfg, ref, bfl = vae_ref
    ours = convert_bfl_state_dict(bfl, cfg)
    theirs = single_file.convert_ldm_vae_checkpoint(dict(bfl), cfg.diffusers_kwargs())
    assert set(ours) == set(theirs) == set(ref.state_dict())
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
        assert torch.equal(ours[k], ref.state_dict()[k]), k


def test_vae_encode_decode_match_reference(vae_ref, tmp_path):
    cfg, ref, bfl = vae_ref
    path = tmp_path / "ae.safetensors"
    save_file(bfl, str(path))
    vae = BagelVAE.from_bfl_file(path, cfg)
    assert vae.downsample == 2 and vae.latent_channels == 4
    g = torch.Generator().manual_seed(6)
    images = torch.rand(2, 3, 16, 24, generator=g) * 2 - 1
    with torch.no_grad():
        mean = ref.encode(images).latent_dist.mean
        latents = vae.encode(images)
        torch.testing.assert_close(latents, cfg.scaling_factor * (mean - cfg.shift_factor), atol=ATOL, rtol=0)
        assert latents.shape == (2, 4, 8, 12)
        z = torch.randn(2, 4, 8, 12, generator=g)
        expected = ref.decode(z / cfg.scaling_factor + cfg.shift_factor).sample
        torch.testing.assert_close(vae.decode(z), expected, atol=ATOL, rtol=0)
        assert torch.equal(vae.encode(images), latents)  # deterministic


def test_vae_bad_state_dict_names_the_keys(vae_ref):
    cfg, _, bfl = vae_ref
    broken = dict(bfl)
    del broken["encoder.mid.attn_1.q.weight"]
    broken["encoder.quant_conv.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"1 missing key\(s\): encoder\.mid\.attn_1\.q\.weight") as err:
        BagelVAE(cfg).load_bfl_state_dict(broken)
    assert "1 unexpected key(s): encoder.quant_conv.weight" in str(err.value)
    with pytest.raises(ValueError, match="missing"):
        convert_bfl_state_dict(bfl, vae_mod.FLUX)  # wrong config: everything mismatches


def test_latent_patchify_round_trip():
    g = torch.Generator().manual_seed(7)
    lat = torch.randn(4, 6, 10, generator=g)
    tokens = patchify_latents(lat, 2)
    assert tokens.shape == (15, 16)
    # token (r, c) holds latent[:, 2r:2r+2, 2c:2c+2] flattened as (p_row, p_col, channel)
    r, c = 1, 3
    torch.testing.assert_close(tokens[r * 5 + c], lat[:, 2 * r:2 * r + 2, 2 * c:2 * c + 2].permute(1, 2, 0).reshape(-1))
    assert torch.equal(unpatchify_latents(tokens, 3, 5, 2, 4), lat)


# ----------------------------------------------------------------------------------------------
# embeddings
# ----------------------------------------------------------------------------------------------


def _numpy_sincos_2d(dim: int, size: int) -> np.ndarray:
    """The reference formula spelled out: a meshgrid with the column coordinate first; each half of
    the dims is [sin, cos] of one coordinate times 1 / 10000**(k / (dim/4))."""
    coords = np.arange(size, dtype=np.float32)
    first, second = np.meshgrid(coords, coords)  # first[i, j] = j (column), second[i, j] = i (row)

    def one_d(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        angles = pos.reshape(-1)[:, None] * omega[None, :]
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    return np.concatenate([one_d(dim // 2, first), one_d(dim // 2, second)], axis=1)


@pytest.mark.parametrize("dim,size", [(64, 8), (3584, 5), (16, 70)])
def test_sincos_table_matches_numpy(dim, size):
    ours = sincos_2d(dim, size)
    assert ours.shape == (size * size, dim) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), _numpy_sincos_2d(dim, size), atol=1e-6, rtol=0)
    pe = PositionEmbedding(size, dim)
    assert not pe.pos_embed.requires_grad
    ids = torch.tensor([0, size + 1, size * size - 1])
    assert torch.equal(pe(ids), ours[ids])


def test_timestep_embedder():
    torch.manual_seed(8)
    te = TimestepEmbedder(32)
    assert [n for n, _ in te.named_parameters()] == ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"]
    t = torch.tensor([0.0, 1.0])
    freq = te.sinusoid(t, 256)
    assert freq.shape == (2, 256)
    torch.testing.assert_close(freq[0], torch.cat([torch.ones(128), torch.zeros(128)]))
    k = torch.arange(128, dtype=torch.float64)
    f = torch.exp(-math.log(10000) * k / 128)
    torch.testing.assert_close(freq[1], torch.cat([f.cos(), f.sin()]).float(), atol=1e-6, rtol=0)
    out = te(t)
    assert out.shape == (2, 32)
    expected = te.mlp[2](torch.nn.functional.silu(te.mlp[0](freq)))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_position_ids_and_patchify():
    assert flattened_position_ids(28, 42, 14, 8).tolist() == [0, 1, 2, 8, 9, 10]
    g = torch.Generator().manual_seed(9)
    image = torch.randn(3, 28, 42, generator=g)
    tokens = patchify(image, 14)
    assert tokens.shape == (6, 14 * 14 * 3)
    torch.testing.assert_close(tokens[4], image[:, 14:28, 14:28].permute(1, 2, 0).reshape(-1))
    assert torch.equal(unpatchify(tokens, 2, 3, 14, 3), image)


# ----------------------------------------------------------------------------------------------
# image transform
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,size,expected", [
    ((1024, 512, 16), (1024, 1024), (1024, 1024)),
    ((1024, 512, 16), (640, 480), (688, 512)),      # short edge up to 512: 682.67 -> 683 -> 688
    ((1024, 512, 16), (4000, 3000), (1024, 768)),   # long edge down to 1024
    ((1024, 512, 16), (3000, 300), (1024, 96)),     # 5120x512 over budget -> 3520x352 -> long edge 1024
    ((980, 224, 14), (100, 50), (448, 224)),
    ((980, 224, 14), (1920, 1080), (980, 546)),     # 551.25 -> 551 -> 546
    ((32, 16, 8), (30, 20), (32, 16)),              # 20/8 = 2.5 rounds half to even -> 16
])
def test_image_transform_target_size(args, size, expected):
    assert BagelImageTransform(*args).target_size(*size) == expected


def test_image_transform_pixels_and_to_pil():
    tf = BagelImageTransform(32, 16, 8)
    clear = Image.new("RGBA", (32, 16), (10, 20, 30, 0))
    x = tf(clear)
    assert x.shape == (3, 16, 32) and torch.equal(x, torch.ones_like(x))  # transparent -> white
    g = np.random.default_rng(10)
    rgb = Image.fromarray(g.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    x = tf(rgb)
    resized = np.asarray(rgb.resize((32, 16), Image.Resampling.BICUBIC), dtype=np.float32)
    expected = torch.from_numpy(resized / 127.5 - 1.0).permute(2, 0, 1)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)
    assert x.min() >= -1 and x.max() <= 1
    back = np.asarray(to_pil(x)).astype(np.int16)  # truncation: float error may lose one level
    assert np.abs(back - resized.astype(np.int16)).max() <= 1
    img = to_pil(torch.tensor([-1.0, 0.0, 2.0]).reshape(3, 1, 1))
    assert img.getpixel((0, 0)) == (0, 127, 255)
