"""V-JEPA 2-AC modules: parity with Meta's reference (cc-vjepa2), cached rollout = native rollout, loader."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.checkpoint import CheckpointError, load_into
from mstar.models.vjepa2.config import TINY_ENCODER, TINY_PREDICTOR, PredictorConfig
from mstar.models.vjepa2.encoder import VJepaEncoder, encode_frames
from mstar.models.vjepa2.loader import dummy_vjepa2, init_random_weights, load_vjepa2_ac
from mstar.models.vjepa2.predictor import ACPredictor
from tests.vjepa2_frame_cache import FrameKVCache, forward_frame
from tests.vjepa2_ref import reference

T = 3  # frames in a trajectory
TOL = 1e-4


@pytest.fixture(autouse=True)
def _quiet():
    # the reference wraps attention in the deprecated torch.backends.cuda.sdp_kernel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _ref_predictor(ref, cfg: PredictorConfig, frames: int = T) -> nn.Module:
    model = ref.VisionTransformerPredictorAC(
        img_size=cfg.img_size, patch_size=cfg.patch_size, num_frames=cfg.tubelet_size * frames,
        tubelet_size=cfg.tubelet_size, embed_dim=cfg.embed_dim, predictor_embed_dim=cfg.predictor_embed_dim,
        depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, qkv_bias=cfg.qkv_bias,
        norm_layer=partial(nn.LayerNorm, eps=cfg.layernorm_eps), use_silu=cfg.use_silu,
        wide_silu=cfg.wide_silu, use_rope=True, is_frame_causal=True, action_embed_dim=cfg.action_dim,
        use_extrinsics=cfg.use_extrinsics,
    )
    return init_random_weights(model, seed=1234).eval()


def _ckpt(tmp_path, predictor_state=None, encoder_state=None):
    wrap = {"predictor": predictor_state or {}, "encoder": encoder_state or {}}
    ckpt = {part: {"module.backbone." + k: v for k, v in sd.items()} for part, sd in wrap.items()}
    path = tmp_path / "vjepa2-ac-tiny.pt"
    torch.save(ckpt, path)
    return path


def _inputs(cfg: PredictorConfig, frames: int = T, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, frames * cfg.tokens_per_frame, cfg.embed_dim, generator=g)
    actions = torch.randn(batch, frames, cfg.action_dim, generator=g)
    states = torch.randn(batch, frames, cfg.action_dim, generator=g)
    extr = torch.randn(batch, frames, cfg.action_dim - 1, generator=g) if cfg.use_extrinsics else None
    return tokens, actions, states, extr


@pytest.fixture(scope="module")
def predictor_pair(tmp_path_factory):
    ref = reference()
    ref_model = _ref_predictor(ref, TINY_PREDICTOR)
    path = _ckpt(tmp_path_factory.mktemp("vjepa2"), predictor_state=ref_model.state_dict())
    _, pred_state = load_vjepa2_ac(path)
    ours = ACPredictor(TINY_PREDICTOR)
    load_into(ours, pred_state)
    return ref_model, ours.eval()


@torch.no_grad()
def test_predictor_forward_full_matches_reference(predictor_pair):
    ref_model, ours = predictor_pair
    tokens, actions, states, _ = _inputs(TINY_PREDICTOR)
    want = ref_model(tokens, actions, states)
    got = ours.forward_full(tokens, actions, states)
    assert got.shape == want.shape == tokens.shape
    assert want.std() > 0.1  # not degenerate
    assert (got - want).abs().max() < TOL
    # shorter trajectories use the top-left corner of the reference's mask
    want2 = ref_model(tokens[:, : 2 * TINY_PREDICTOR.tokens_per_frame], actions[:, :2], states[:, :2])
    got2 = ours.forward_full(tokens[:, : 2 * TINY_PREDICTOR.tokens_per_frame], actions[:, :2], states[:, :2])
    assert (got2 - want2).abs().max() < TOL


@torch.no_grad()
@pytest.mark.parametrize("variant", ["extrinsics_silu", "nonsquare"])
def test_predictor_variants_match_reference(tmp_path, variant):
    ref = reference()
    if variant == "extrinsics_silu":
        cfg = PredictorConfig(img_size=(32, 32), embed_dim=64, predictor_embed_dim=48, depth=2, num_heads=4,
                              use_extrinsics=True, use_silu=True)
    else:  # 2x3 grid: width positions are scaled by grid_h / grid_w
        cfg = PredictorConfig(img_size=(32, 48), embed_dim=64, predictor_embed_dim=48, depth=2, num_heads=4)
    ref_model = _ref_predictor(ref, cfg)
    ours = ACPredictor(cfg)
    load_into(ours, load_vjepa2_ac(_ckpt(tmp_path, predictor_state=ref_model.state_dict()))[1])
    tokens, actions, states, extr = _inputs(cfg)
    want = ref_model(tokens, actions, states, extr)
    got = ours.eval().forward_full(tokens, actions, states, extr)
    assert (got - want).abs().max() < TOL


@torch.no_grad()
def test_cached_rollout_equals_native(predictor_pair):
    ref_model, ours = predictor_pair
    cfg = TINY_PREDICTOR
    n = cfg.tokens_per_frame
    tokens, actions, states, _ = _inputs(cfg, seed=1)
    cache = FrameKVCache.empty(ours.cfg.depth)
    for t in range(1, T + 1):
        native = ours.forward_full(tokens[:, : t * n], actions[:, :t], states[:, :t])[:, -n:]
        native_ref = ref_model(tokens[:, : t * n], actions[:, :t], states[:, :t])[:, -n:]
        cached = forward_frame(ours, tokens[:, (t - 1) * n: t * n], actions[:, t - 1], states[:, t - 1],
                               frame_index=t - 1, cache=cache)
        assert cached.shape == (tokens.shape[0], n, cfg.embed_dim)
        assert (cached - native).abs().max() < TOL, t
        assert (cached - native_ref).abs().max() < TOL, t
    assert cache.num_frames == T
    assert cache.length == T * cfg.block_tokens
    k = cache.layers[0].k
    assert k is not None and k.shape == (tokens.shape[0], cfg.num_heads, T * cfg.block_tokens, cfg.head_dim)
    with pytest.raises(ValueError, match="frame_index"):
        forward_frame(ours, tokens[:, :n], actions[:, 0], states[:, 0], frame_index=0, cache=cache)


@torch.no_grad()
def test_autoregressive_rollout_cached_equals_native():
    # the world-model wrapper's loop: feed back each layer-normed prediction as the next frame
    encoder, predictor = dummy_vjepa2(seed=3)
    cfg = predictor.cfg
    n = cfg.tokens_per_frame
    g = torch.Generator().manual_seed(5)
    frame0 = encode_frames(encoder, torch.randn(1, 1, 3, 32, 32, generator=g))
    actions = torch.randn(1, T, cfg.action_dim, generator=g)
    states = torch.randn(1, T, cfg.action_dim, generator=g)

    traj_native = frame0
    for t in range(1, T + 1):
        nxt = predictor.forward_full(traj_native, actions[:, :t], states[:, :t])[:, -n:]
        traj_native = torch.cat([traj_native, F.layer_norm(nxt, (nxt.shape[-1],))], dim=1)

    cache = FrameKVCache.empty(predictor.cfg.depth)
    traj_cached, cur = frame0, frame0
    for t in range(T):
        nxt = forward_frame(predictor, cur, actions[:, t], states[:, t], frame_index=t, cache=cache)
        cur = F.layer_norm(nxt, (nxt.shape[-1],))
        traj_cached = torch.cat([traj_cached, cur], dim=1)
    assert (traj_cached - traj_native).abs().max() < TOL


@torch.no_grad()
def test_encoder_matches_reference():
    ref = reference()
    c = TINY_ENCODER
    ref_model = ref.VisionTransformer(
        img_size=c.img_size, patch_size=c.patch_size, num_frames=4, tubelet_size=c.tubelet_size,
        in_chans=c.in_chans, embed_dim=c.embed_dim, depth=c.depth, num_heads=c.num_heads,
        mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias, norm_layer=partial(nn.LayerNorm, eps=c.layernorm_eps),
        use_rope=True, use_sdpa=True,
    )
    init_random_weights(ref_model, seed=77).eval()
    ours = VJepaEncoder(c)
    load_into(ours, ref_model.state_dict())
    ours.eval()
    g = torch.Generator().manual_seed(0)
    video = torch.randn(2, 3, 4, 32, 32, generator=g)
    want = ref_model(video)
    got = ours(video)
    assert got.shape == want.shape == (2, 2 * c.tokens_per_frame, c.embed_dim)
    assert (got - want).abs().max() < TOL
    # another resolution / length (RoPE positions follow the input grid)
    video = torch.randn(1, 3, 6, 48, 32, generator=g)
    assert (ours(video) - ref_model(video)).abs().max() < TOL


def test_rope_split_and_mask_facts():
    ref = reference()
    # head_dim 64 (ViT-g and the AC predictor): 3 x 20 rotated channels + 4 passed through
    attn = ref.modules.ACRoPEAttention(1024, num_heads=16)
    assert (attn.d_dim, attn.h_dim, attn.w_dim) == (20, 20, 20)
    m = ref.modules.build_action_block_causal_attention_mask(3, 2, 2, add_tokens=2)
    frame_of = torch.arange(3).repeat_interleave(6)
    assert torch.equal(m, frame_of[:, None] >= frame_of[None, :])


def test_loader_strips_prefixes_and_reports_missing(tmp_path):
    _, predictor = dummy_vjepa2(seed=0)
    encoder = VJepaEncoder(TINY_ENCODER)
    state = predictor.state_dict()
    path = _ckpt(tmp_path, predictor_state=state, encoder_state=encoder.state_dict())
    raw = torch.load(path, weights_only=True)
    assert all(k.startswith("module.backbone.") for k in raw["predictor"])
    enc_state, pred_state = load_vjepa2_ac(path)
    assert set(pred_state) == set(state) and set(enc_state) == set(encoder.state_dict())

    fresh = ACPredictor(TINY_PREDICTOR)
    load_into(fresh, pred_state)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())

    broken = dict(pred_state)
    del broken["predictor_blocks.1.attn.qkv.weight"]
    broken["predictor_blocks.9.extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"missing: predictor_blocks\.1\.attn\.qkv\.weight") as e:
        load_into(fresh, broken)
    assert "unexpected: predictor_blocks.9.extra" in str(e.value)
    broken = dict(pred_state)
    broken["predictor_norm.weight"] = torch.ones(5)
    with pytest.raises(CheckpointError, match="shape mismatch: predictor_norm.weight"):
        load_into(fresh, broken)

    torch.save({"predictor": {}}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="no 'encoder' state dict"):
        load_vjepa2_ac(tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError):
        load_vjepa2_ac(tmp_path / "absent.pt")


def test_dummy_is_deterministic():
    e1, p1 = dummy_vjepa2(seed=7)
    e2, p2 = dummy_vjepa2(seed=7)
    for a, b in ((e1, e2), (p1, p2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    _, p3 = dummy_vjepa2(seed=8)
    assert not torch.equal(p1.state_dict()["predictor_proj.weight"], p3.state_dict()["predictor_proj.weight"])


def test_hf_encoder_layout_loads_and_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mstar.models.vjepa2.loader import init_random_weights, load_hf_encoder

    cfg = transformers.VJEPA2Config(crop_size=32, patch_size=16, frames_per_clip=4, tubelet_size=2, hidden_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4.0, pred_hidden_size=48,
                                    pred_num_hidden_layers=1, pred_num_attention_heads=4)
    hf = init_random_weights(transformers.VJEPA2Model(cfg), 3).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf_encoder(tmp_path)
    video = torch.randn(1, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # [B, T, C, H, W]
    with torch.no_grad():
        ref = hf(pixel_values_videos=video, skip_predictor=True).last_hidden_state
        got = ours(video.permute(0, 2, 1, 3, 4))  # ours takes [B, C, T, H, W]
    assert float(ref.std()) > 0.1
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_qkv_rows_are_the_rotated_projection_bit_for_bit(monkeypatch, kernel):
    """``Attention.qkv_rows`` (q and k rotated in place by the compiled pairs kernel, or the PyTorch
    fallback) gives exactly ``_qkv``'s values, as [tokens, heads, head_dim] rows."""
    from mstar.layers.cpu_ops import ops
    from mstar.layers.prepack import prepack_linears
    from mstar.models.vjepa2.blocks import Attention
    from mstar.models.vjepa2.rope import rope_tables

    if kernel == "torch":
        monkeypatch.setenv("MSTAR_KERNELS", "torch")
    elif ops() is None:
        pytest.skip("the compiled kernels are not built here")
    torch.manual_seed(3)
    attn = Attention(96, 4, qkv_bias=True)
    prepack_linears(attn)
    x = torch.randn(50, 96) * 3
    pos = torch.arange(50)
    cos, sin = rope_tables(24, pos // 25, pos % 5, pos % 7)
    q, k, v = attn.qkv_rows(x, cos, sin)
    rq, rk, rv = attn._qkv(x.unsqueeze(0), cos, sin)
    for got, ref in ((q, rq), (k, rk), (v, rv)):
        assert got.shape == (50, 4, 24)
        assert torch.equal(got, ref[0].transpose(0, 1))


def test_block_forward_rows_fuses_bias_residual_and_gelu():
    """``Block.forward_rows`` (projection after attention and the MLP through the prepacked weights,
    bias and residual in the kernel's store, the GELU in the first MLP projection's store) gives the
    modules' values within float32 rounding (GELU's erf differs from PyTorch's in the last bits);
    with a hook on a module it runs the modules and the hook sees the call."""
    from mstar.layers.prepack import prepack_linears
    from mstar.models.vjepa2.blocks import Block
    from mstar.models.vjepa2.rope import rope_tables

    torch.manual_seed(4)
    blk = Block(96, 4, 384, qkv_bias=True, use_silu=False, wide_silu=False, eps=1e-6)
    for prm in blk.parameters():  # non-trivial norms and biases
        prm.data.add_(torch.randn_like(prm) * 0.1)
    prepack_linears(blk)
    x = torch.randn(40, 96)
    pos = torch.arange(40)
    cos, sin = rope_tables(24, pos // 20, pos % 4, pos % 5)

    def attend(q, k, v):  # [L, H, D] rows
        return F.scaled_dot_product_attention(q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(),
                                              v.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()

    with torch.inference_mode():
        q, k, v = blk.attn.qkv_rows(blk.norm1(x), cos, sin)
        ref = x + blk.attn._out(attend(q, k, v).transpose(0, 1).unsqueeze(0))[0]
        ref = ref + blk.mlp(blk.norm2(ref))
        torch.testing.assert_close(blk.forward_rows(x, cos, sin, attend), ref, rtol=1e-5, atol=1e-5)
        seen = []
        handle = blk.mlp.fc2.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        torch.testing.assert_close(blk.forward_rows(x, cos, sin, attend), ref, rtol=1e-5, atol=1e-5)
        handle.remove()
        assert seen == [torch.Size([40, 96])]
        handle = blk.mlp.act.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        assert torch.equal(blk.forward_rows(x, cos, sin, attend), ref)  # a hooked GELU: the modules' bits
        assert blk.lean() is None
        handle.remove()
        assert seen[-1] == torch.Size([40, 384])
        # the lean path: the same kernel calls, the same bits; none once a weight changed
        assert torch.equal(blk.lean()(x, cos, sin, attend), blk.forward_rows(x, cos, sin, attend))
        blk.mlp.fc1.weight.mul_(1.0)  # in place: a new version of the packed weight
        assert blk.lean() is None
