"""BAGEL MoT LLM blocks vs transformers Qwen3 attention/MLP (one weight set) and a plain oracle (mixed)."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.paged_attention import AttentionMetadata, QueryMode
from mstar.model.submodule import EngineInputs
from mstar.models.bagel.config import BAGEL_7B_MOT, TINY, BagelLLMConfig
from mstar.models.bagel.mot import MoTDecoderLayer, MoTLLM

ATOL = 1e-4
LENS = (5, 3)  # two causal prefill sequences of different lengths
BLOCK = 4


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _engine_inputs(cfg: BagelLLMConfig, lens=LENS, num_blocks: int = 16) -> EngineInputs:
    shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    free = list(range(num_blocks))
    slots, positions, tables = [], [], []
    for n in lens:
        table = [free.pop(0) for _ in range(-(-n // BLOCK))]
        tables.append(table)
        for pos in range(n):
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
    modes = [QueryMode.CAUSAL_APPEND] * len(lens)
    meta = AttentionMetadata.build(list(lens), tables, list(lens), modes, slots)
    b = len(lens)
    return EngineInputs(walks=["prefill"] * b, nodes=["LLM"] * b, request_ids=[str(i) for i in range(b)],
                        infos=[], splits={}, args=[None] * b, attention=meta, kv_caches=caches,
                        positions=torch.tensor(positions, dtype=torch.long), num_tokens=list(lens))


# -- transformers reference (one weight set) ---------------------------------------------------------
def _hf_reference(cfg: BagelLLMConfig, layer: MoTDecoderLayer, sfx: str):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3Attention,
        Qwen3MLP,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
    )

    hf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                     num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, attention_bias=True,
                     rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    hf._attn_implementation = "eager"
    attn, mlp = Qwen3Attention(hf, 0).eval(), Qwen3MLP(hf).eval()
    ln_in, ln_post = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), Qwen3RMSNorm(cfg.hidden_size,
                                                                                    cfg.rms_norm_eps)
    rope = Qwen3RotaryEmbedding(hf)
    a = layer.self_attn
    with torch.no_grad():
        for p in ("q", "k", "v", "o"):
            src, dst = getattr(a, f"{p}_proj{sfx}"), getattr(attn, f"{p}_proj")
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias if src.bias is not None else torch.zeros_like(dst.bias))  # o: no bias
        attn.q_norm.weight.copy_(getattr(a, f"q_norm{sfx}").weight)
        attn.k_norm.weight.copy_(getattr(a, f"k_norm{sfx}").weight)
        mlp.load_state_dict(getattr(layer, f"mlp{sfx}").state_dict())
        ln_in.weight.copy_(getattr(layer, f"input_layernorm{sfx}").weight)
        ln_post.weight.copy_(getattr(layer, f"post_attention_layernorm{sfx}").weight)

    def run(x: torch.Tensor, lens=LENS) -> torch.Tensor:
        outs, start = [], 0
        with torch.no_grad():
            for n in lens:
                xs = x[start:start + n].unsqueeze(0)
                start += n
                pe = rope(xs, torch.arange(n).unsqueeze(0))
                mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
                h = xs + attn(ln_in(xs), pe, mask)[0]
                outs.append((h + mlp(ln_post(h)))[0])
        return torch.cat(outs)

    return run


# -- plain-PyTorch oracle (per-token weight set, shared attention) -------------------------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _oracle_layer(cfg: BagelLLMConfig, layer: MoTDecoderLayer, x, gen_mask, positions, lens=LENS):
    """Every op computed with both sets on all tokens, then each token takes its own set's result."""
    p = dict(layer.named_parameters())
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    m = gen_mask[:, None]

    def pick(f):
        return torch.where(m if f("").dim() == 2 else m[:, :, None], f("_moe_gen"), f(""))

    def lin(name, inp, s):
        b = p.get(f"{name}{s}.bias")
        out = inp @ p[f"{name}{s}.weight"].T
        return out if b is None else out + b

    t = x.shape[0]
    h_in = pick(lambda s: _rms(x, p[f"input_layernorm{s}.weight"], eps))
    q = pick(lambda s: _rms(lin("self_attn.q_proj", h_in, s).view(t, nh, hd),
                            p[f"self_attn.q_norm{s}.weight"], eps))
    k = pick(lambda s: _rms(lin("self_attn.k_proj", h_in, s).view(t, nkv, hd),
                            p[f"self_attn.k_norm{s}.weight"], eps))
    v = pick(lambda s: lin("self_attn.v_proj", h_in, s).view(t, nkv, hd))
    q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        start += n
        s = torch.einsum("qhd,khd->hqk", q[sl], k[sl]) * hd ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[sl]))
    attn = torch.cat(outs).reshape(t, nh * hd)
    h = x + pick(lambda s: lin("self_attn.o_proj", attn, s))
    h2 = pick(lambda s: _rms(h, p[f"post_attention_layernorm{s}.weight"], eps))

    def mlp(s):
        g, u = lin("mlp" + s + ".gate_proj", h2, ""), lin("mlp" + s + ".up_proj", h2, "")
        return lin("mlp" + s + ".down_proj", torch.nn.functional.silu(g) * u, "")

    return h + pick(mlp)


def _layer(seed=0):
    layer = MoTDecoderLayer(TINY, 0).eval()
    _randomize(layer, seed)
    return layer


def _run_layer(layer, x, gen_mask):
    ei = _engine_inputs(TINY)
    cos, sin = MoTLLM(TINY).model.rotary_emb(ei.positions)
    with torch.no_grad():
        return layer(x, gen_mask, cos, sin, ei), ei


# -- tests ---------------------------------------------------------------------------------------------
def test_config():
    assert BAGEL_7B_MOT.head_dim == 128 and BAGEL_7B_MOT.num_key_value_heads == 4
    assert TINY.head_dim == 16 and TINY.rope_scaling is None
    with pytest.raises(ValueError, match="multiple"):
        BagelLLMConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(AttributeError):
        TINY.hidden_size = 3  # frozen


def test_parameter_names_match_checkpoint():
    names = set(dict(MoTLLM(TINY).named_parameters()))
    expected = {"model.embed_tokens.weight", "model.norm.weight", "model.norm_moe_gen.weight",
                "lm_head.weight"}
    for i in range(TINY.num_hidden_layers):
        pre = f"language_model.model.layers.{i}."
        for s in ("", "_moe_gen"):
            for proj in ("q", "k", "v"):
                expected |= {f"{pre}self_attn.{proj}_proj{s}.weight", f"{pre}self_attn.{proj}_proj{s}.bias"}
            expected.add(f"{pre}self_attn.o_proj{s}.weight")
            expected |= {f"{pre}self_attn.q_norm{s}.weight", f"{pre}self_attn.k_norm{s}.weight"}
            expected |= {f"{pre}mlp{s}.{w}_proj.weight" for w in ("gate", "up", "down")}
            expected |= {f"{pre}input_layernorm{s}.weight", f"{pre}post_attention_layernorm{s}.weight"}
    expected = {n.removeprefix("language_model.") for n in expected}
    assert names == expected


@pytest.mark.parametrize("all_gen", [False, True])
def test_single_set_matches_transformers_qwen3(all_gen):
    layer = _layer()
    x = torch.randn(sum(LENS), TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    gen_mask = torch.full((x.shape[0],), all_gen)
    ours, ei = _run_layer(layer, x, gen_mask)
    ref = _hf_reference(TINY, layer, "_moe_gen" if all_gen else "")(x)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=ATOL)
    # the oracle agrees with transformers too, and the other set gives a different answer
    oracle = _oracle_layer(TINY, layer, x, gen_mask, ei.positions)
    torch.testing.assert_close(oracle, ref, atol=ATOL, rtol=ATOL)
    other = _hf_reference(TINY, layer, "" if all_gen else "_moe_gen")(x)
    assert (other - ref).abs().max() > 1e-2
    if not all_gen:  # gen_mask=None means all understanding
        torch.testing.assert_close(_run_layer(layer, x, None)[0], ours, atol=0, rtol=0)


def test_mixed_mask_matches_oracle_and_shares_attention():
    layer = _layer()
    x = torch.randn(sum(LENS), TINY.hidden_size, generator=torch.Generator().manual_seed(2))
    gen_mask = torch.tensor([False, False, True, True, False, True, False, True])
    ours, ei = _run_layer(layer, x, gen_mask)
    ref = _oracle_layer(TINY, layer, x, gen_mask, ei.positions)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=ATOL)
    # attention is shared: a mixed batch differs from stitching the two single-set runs together
    und = _run_layer(layer, x, torch.zeros(8, dtype=torch.bool))[0]
    gen = _run_layer(layer, x, torch.ones(8, dtype=torch.bool))[0]
    stitched = torch.where(gen_mask[:, None], gen, und)
    assert (stitched - ours).abs().max() > 1e-3
    # the first token of each sequence only sees itself: equals its own set's single-set run
    for row in (0, 5):
        src = gen if gen_mask[row] else und
        torch.testing.assert_close(ours[row], src[row], atol=ATOL, rtol=ATOL)


def test_full_llm_matches_oracle_and_fills_cache():
    model = MoTLLM(TINY).eval()
    _randomize(model, 3)
    ids = torch.randint(0, TINY.vocab_size, (sum(LENS),), generator=torch.Generator().manual_seed(4))
    gen_mask = torch.tensor([True, False, False, True, True, False, True, True])
    ei = _engine_inputs(TINY)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, ei, gen_mask=gen_mask))
        h = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            h = _oracle_layer(TINY, layer, h, gen_mask, ei.positions)
        h = torch.where(gen_mask[:, None], _rms(h, model.model.norm_moe_gen.weight, TINY.rms_norm_eps),
                        _rms(h, model.model.norm.weight, TINY.rms_norm_eps))
        ref = model.lm_head(h)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=ATOL)
    assert logits.shape == (sum(LENS), TINY.vocab_size)
    written = ei.attention.slot_mapping
    k0 = ei.kv_caches[0][0].view(-1, TINY.num_key_value_heads, TINY.head_dim)
    assert k0[written].abs().sum(dim=(1, 2)).gt(0).all()
    spec = model.kv_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)


def test_bad_gen_mask_rejected():
    layer = _layer()
    x = torch.randn(sum(LENS), TINY.hidden_size)
    with pytest.raises(ValueError, match="gen_mask"):
        _run_layer(layer, x, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="gen_mask"):
        _run_layer(layer, x, torch.zeros(sum(LENS), dtype=torch.long))
