"""A plain-PyTorch oracle of BAGEL inference, the t2i benchmark's baseline and the tests' reference:
dense per-context K/V tensors, the MoT layer math written out from the weights, every guidance branch
as its own sequential pass, and the reference inferencer's guidance combination and renormalisation.

It shares only WEIGHTS and the stateless components (ViT, VAE, image transforms, tested on their
own against transformers / diffusers) with the served model; attention, caching, positions, the
flow schedule and CFG are independent re-implementations of the reference code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.models.bagel.embeddings import flattened_position_ids
from mstar.models.bagel.vae import patchify_latents


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rot * sin


class DenseBagel:
    """``node``: the served ``BagelLLMNode`` (weights only); ``vit``/``vae``: its components."""

    def __init__(self, node, vit=None, vae=None, patch: int = 2):
        self.node, self.vit, self.vae, self.patch = node, vit, vae, patch
        self.cfg = node.language_model.cfg
        self.lm = node.language_model.model

    # -- one forward over new tokens against a dense context --------------------------------------
    def forward(self, x, gen, pos, ctx, causal):
        """``ctx``: list per layer of (K, V) ``[P, kv, hd]``. Returns (final hidden, new ctx).

        As the reference: each weight set runs on its own rows only (index split), attention is one
        fused call over the cached K/V followed by the new tokens' K/V."""
        c = self.cfg
        gi, ui = gen.nonzero().squeeze(1), (~gen).nonzero().squeeze(1)
        eps = c.rms_norm_eps

        def split(t, f_und, f_gen):
            out_u, out_g = f_und(t[ui]), f_gen(t[gi])
            out = out_u.new_empty((t.shape[0], *out_u.shape[1:]))
            out[ui], out[gi] = out_u, out_g
            return out

        def lin(m):
            return lambda t: F.linear(t, m.weight, m.bias)

        def norm(m):
            return lambda t: _rms(t, m.weight, eps)

        def mlp(m):
            return lambda t: _mlp(m, t)

        new_ctx = []
        h = x
        t = x.shape[0]
        rep = c.num_attention_heads // c.num_key_value_heads
        for i, layer in enumerate(self.lm.layers):
            a = layer.self_attn
            n = split(h, norm(layer.input_layernorm), norm(layer.input_layernorm_moe_gen))
            q = split(n, lin(a.q_proj), lin(a.q_proj_moe_gen)).view(t, c.num_attention_heads, c.head_dim)
            k = split(n, lin(a.k_proj), lin(a.k_proj_moe_gen)).view(t, c.num_key_value_heads, c.head_dim)
            v = split(n, lin(a.v_proj), lin(a.v_proj_moe_gen)).view(t, c.num_key_value_heads, c.head_dim)
            q = split(q, norm(a.q_norm), norm(a.q_norm_moe_gen))
            k = split(k, norm(a.k_norm), norm(a.k_norm_moe_gen))
            q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
            pk, pv = ctx[i] if ctx else (k[:0], v[:0])
            keys, vals = torch.cat([pk, k]), torch.cat([pv, v])
            new_ctx.append((keys, vals))
            mask = None
            if causal:
                p = pk.shape[0]
                mask = torch.arange(keys.shape[0])[None, :] <= (p + torch.arange(t))[:, None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(rep, 1).transpose(0, 1),
                                               vals.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
            o = o.transpose(0, 1).reshape(t, -1)
            h = h + split(o, lin(a.o_proj), lin(a.o_proj_moe_gen))
            n = split(h, norm(layer.post_attention_layernorm), norm(layer.post_attention_layernorm_moe_gen))
            h = h + split(n, mlp(layer.mlp), mlp(layer.mlp_moe_gen))
        return split(h, norm(self.lm.norm), norm(self.lm.norm_moe_gen)), new_ctx

    # -- inputs -----------------------------------------------------------------------------------
    def embed(self, ids):
        return self.lm.embed_tokens.weight[torch.tensor(ids, dtype=torch.long)]

    def latent_block(self, lat, t, h, w):
        nd = self.node
        ids = flattened_position_ids(h, w, 1, nd.max_latent_size)
        temb = nd.time_embedder(torch.tensor([t], dtype=torch.float32))
        body = F.linear(lat, nd.vae2llm.weight, nd.vae2llm.bias) + temb + nd.latent_pos_embed.pos_embed[ids]
        tok = nd.tokens
        x = torch.cat([self.embed([tok.vision_start]), body, self.embed([tok.vision_end])])
        gen = torch.zeros(x.shape[0], dtype=torch.bool)
        gen[1:-1] = True
        return x, gen


def _mlp(m, x):
    return F.linear(F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight), m.down_proj.weight)


class Context:
    """A dense context: per-layer K/V, next RoPE position."""

    def __init__(self):
        self.kv, self.rope = None, 0

    def copy(self):
        c = Context()
        c.kv = None if self.kv is None else [(k.clone(), v.clone()) for k, v in self.kv]
        c.rope = self.rope
        return c

    @property
    def length(self):
        return 0 if self.kv is None else self.kv[0][0].shape[0]


@torch.inference_mode()
def add_text(model: DenseBagel, ctx: Context, ids: list[int]):
    tok = model.node.tokens
    full = [tok.im_start, *ids, tok.im_end]
    pos = torch.arange(ctx.rope, ctx.rope + len(full))
    _, ctx.kv = model.forward(model.embed(full), torch.zeros(len(full), dtype=torch.bool), pos, ctx.kv, causal=True)
    ctx.rope += len(full)


@torch.inference_mode()
def add_vit(model: DenseBagel, ctx: Context, pixels: torch.Tensor):
    tok = model.node.tokens
    body = model.vit([pixels])[0]
    x = torch.cat([model.embed([tok.vision_start]), body, model.embed([tok.vision_end])])
    pos = torch.full((x.shape[0],), ctx.rope)
    _, ctx.kv = model.forward(x, torch.zeros(x.shape[0], dtype=torch.bool), pos, ctx.kv, causal=False)
    ctx.rope += 1


@torch.inference_mode()
def add_vae(model: DenseBagel, ctx: Context, pixels: torch.Tensor):
    lat = model.vae.encode(pixels[None])[0]
    h, w = lat.shape[1] // model.patch, lat.shape[2] // model.patch
    x, gen = model.latent_block(patchify_latents(lat, model.patch), 0.0, h, w)
    pos = torch.full((x.shape[0],), ctx.rope)
    _, ctx.kv = model.forward(x, gen, pos, ctx.kv, causal=False)
    ctx.rope += 1


@torch.inference_mode()
def velocity(model: DenseBagel, ctx: Context, block):
    """One pass of the step's packed query block against ``ctx``, read-only (nothing is stored)."""
    x, gen = block
    hid, _ = model.forward(x, gen, torch.full((x.shape[0],), ctx.rope), ctx.kv, causal=False)
    nd = model.node
    return F.linear(hid[1:-1], nd.llm2vae.weight, nd.llm2vae.bias)


@torch.inference_mode()
def generate_image(model: DenseBagel, main: Context, cfg_text: Context, cfg_img: Context, noise, h, w, *,
                   cfg_text_scale, cfg_img_scale, cfg_interval, renorm_type, renorm_min=0.0, num_timesteps=50,
                   shift=3.0):
    """The reference's generate_image/_forward_flow loop: three sequential passes per step."""
    ts = torch.linspace(1, 0, num_timesteps)
    ts = shift * ts / (1 + (shift - 1) * ts)
    dts = ts[:-1] - ts[1:]
    x = noise
    for i, t in enumerate(ts[:-1]):
        if t > cfg_interval[0] and t <= cfg_interval[1]:
            st, si = cfg_text_scale, cfg_img_scale
        else:
            st, si = 1.0, 1.0
        block = model.latent_block(x, float(t), h, w)  # built once, queried by every pass
        v = velocity(model, main, block)
        if st > 1.0:
            vt_ = velocity(model, cfg_text, block)
        if si > 1.0:
            vi_ = velocity(model, cfg_img, block)
        if st > 1.0:
            if renorm_type == "text_channel":
                v_text = vt_ + st * (v - vt_)
                sc = (torch.norm(v, dim=-1, keepdim=True) / (torch.norm(v_text, dim=-1, keepdim=True) + 1e-8))
                v_text = v_text * sc.clamp(min=renorm_min, max=1.0)
                v = vi_ + si * (v_text - vi_) if si > 1.0 else v_text
            else:
                v_text = vt_ + st * (v - vt_)
                v_new = vi_ + si * (v_text - vi_) if si > 1.0 else v_text
                if renorm_type == "global":
                    n0, n1 = torch.norm(v), torch.norm(v_new)
                else:
                    n0, n1 = torch.norm(v, dim=-1, keepdim=True), torch.norm(v_new, dim=-1, keepdim=True)
                v = v_new * (n0 / (n1 + 1e-8)).clamp(min=renorm_min, max=1.0)
        x = x - v * dts[i]
    return x


@torch.inference_mode()
def greedy_decode(model: DenseBagel, ctx: Context, max_tokens: int) -> list[int]:
    """The reference's generate_text: feed <|im_start|>, then each argmax, until <|im_end|>."""
    ctx = ctx.copy()
    tok = model.node.tokens.im_start
    out = []
    for _ in range(max_tokens):
        pos = torch.tensor([ctx.rope])
        hid, ctx.kv = model.forward(model.embed([tok]), torch.zeros(1, dtype=torch.bool), pos, ctx.kv, causal=True)
        ctx.rope += 1
        tok = int(F.linear(hid[-1], model.node.language_model.lm_head.weight).argmax())
        out.append(tok)
        if tok == model.node.tokens.im_end:
            break
    return out
