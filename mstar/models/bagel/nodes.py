"""BAGEL's node computations: the Mixture-of-Transformers ``LLM`` (and its guidance views), the ViT and
VAE encoders, ``combine_cfg`` and the VAE decoder.

The ``LLM`` module serves every walk and batches them together (prefills, flow-step queries of all
three guidance branches, text decode). Its per-request inputs are uniform: ``x`` (input embeddings
``[n, hidden]``), ``gen`` (bool ``[n]``: generation-expert tokens) and ``pos`` (RoPE positions
``[n]``), so any mix of walks runs as one forward over the paged cache:

* ``prefill_text``: ``[<|im_start|>, text, <|im_end|>]``, causal, appended to the main cache (and, for
  requests that guide on the image, to the text-only ``LLM_cfg_img`` cache at its own positions);
* ``prefill_vit`` / ``prefill_vae``: ``[<|vision_start|>, image tokens, <|vision_end|>]`` at ONE
  position, bidirectional inside the block ("block append"); VAE tokens use the generation experts;
* flow steps: the same block shape over the noisy latents, READ-ONLY against the branch's context
  (``LLM``: the main cache; ``LLM_cfg_text``: a fork of its prefix; ``LLM_cfg_img``: the text-only
  cache); a branch whose guidance is off at this step brings no tokens at all;
* ``decode``: one token per step, causal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.layers.paged_attention import QueryMode
from mstar.layers.prepack import PrepackableLinear
from mstar.layers.sampling import SamplingParams, sample
from mstar.layers.sampling import request_sampling as sampling_from_request
from mstar.model import KVSequence, NodeInputs, NodeSubmodule
from mstar.model.decode import generation_finish, stop_token_set
from mstar.models.bagel.config import BagelLLMConfig
from mstar.models.bagel.embeddings import PositionEmbedding, TimestepEmbedder, flattened_position_ids
from mstar.models.bagel.flow import cfg_combine, timestep_schedule
from mstar.models.bagel.image_transform import InputImageTransforms
from mstar.models.bagel.layout import Ctx
from mstar.models.bagel.mot import MoTLLM
from mstar.models.bagel.walks import BagelWalk

__all__ = ["BagelLLMNode", "CombineCFG", "SpecialTokens", "VAEDecoderNode", "VAEEncoderNode", "ViTNode",
           "request_sampling"]

DEFAULT_SAMPLING: Mapping[str, Any] = {"temperature": 0.0, "max_tokens": 256}
_BRANCH = {"LLM": "main", "LLM_cfg_text": "cfg_text", "LLM_cfg_img": "cfg_img"}
_OUTPUTS = ("latents", "time_index", "stop", "v_main", "v_cfg_text", "v_cfg_img", "token", "text")
_EMPTY = torch.zeros(0)


@dataclass(frozen=True, slots=True)
class _Decode:
    """A decode step's args: the token it samples (its step) and how."""

    sampling: SamplingParams
    step: int
    stop_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class _Flow:
    """A flow query's args: its guidance branch and Euler step; ``latents`` None when the branch is
    off at this step (no tokens)."""

    branch: str  # "main", "cfg_text", "cfg_img"
    single: bool  # no guidance walk: the main branch takes the Euler step itself
    i: int  # the step
    dt: float
    last: bool
    latents: torch.Tensor | None


_PREFILL = None  # a prefill block's args: nothing besides its tokens


class SpecialTokens:
    """Ids of the four tokens BAGEL adds to its tokenizer."""

    def __init__(self, im_start: int, im_end: int, vision_start: int, vision_end: int) -> None:
        self.im_start, self.im_end = im_start, im_end
        self.vision_start, self.vision_end = vision_start, vision_end

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.im_start, self.im_end, self.vision_start, self.vision_end


def request_sampling(params: Mapping[str, Any]) -> SamplingParams:
    """Decode sampling: greedy and 256 new tokens by default (see ``mstar.layers.sampling``). The
    text decoder keeps no seen tokens, so a repetition penalty is refused rather than ignored."""
    sp = sampling_from_request(params, DEFAULT_SAMPLING)
    if sp.repetition_penalty != 1.0:
        raise ValueError("repetition_penalty is not supported by BAGEL's text decoding")
    return sp


class BagelLLMNode(NodeSubmodule):
    """``language_model`` + the generation adapters (``time_embedder``, ``vae2llm``, ``llm2vae``,
    ``latent_pos_embed``), with BAGEL's checkpoint names."""

    def __init__(self, cfg: BagelLLMConfig, latent_dim: int, max_latent_size: int, tokens: SpecialTokens,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.language_model = MoTLLM(cfg, dtype=dtype)
        self.time_embedder = TimestepEmbedder(h).to(dtype)
        self.vae2llm = nn.Linear(latent_dim, h, dtype=dtype)
        self.llm2vae = PrepackableLinear(h, latent_dim, dtype=dtype)
        self.latent_pos_embed = PositionEmbedding(max_latent_size, h).to(dtype)
        self.max_latent_size = max_latent_size
        self.tokens = tokens
        self.kv_spec = self.language_model.kv_spec(dtype)
        self._pos_rows: dict[tuple[int, int], torch.Tensor] = {}  # latent grid -> position embedding rows
        self._t_emb: dict[float, torch.Tensor] = {}  # flow time -> timestep embedding

    def _load_from_state_dict(self, *args, **kwargs):  # new weights: drop what was derived from the old
        self._pos_rows.clear()
        self._t_emb.clear()
        super()._load_from_state_dict(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.language_model.model.embed_tokens(torch.tensor(ids, dtype=torch.long))

    def latent_tokens(self, latents: torch.Tensor, t: float, h: int, w: int) -> torch.Tensor:
        """Noisy (or clean, t=0) latent tokens ``[h*w, D]`` -> LLM inputs: vae2llm + time + 2-D position."""
        pos = self._pos_rows.get((h, w))
        if pos is None:
            if len(self._pos_rows) > 256:
                self._pos_rows.clear()
            ids = flattened_position_ids(h, w, 1, self.max_latent_size)
            pos = self._pos_rows[(h, w)] = self.latent_pos_embed(ids)
        t_emb = self._t_emb.get(t)
        if t_emb is None:
            if len(self._t_emb) > 4096:
                self._t_emb.clear()
            t_emb = self._t_emb[t] = self.time_embedder(torch.tensor([t], dtype=torch.float32)).to(self.dtype)
        return torch.addmm(pos + t_emb, latents.to(self.dtype), self.vae2llm.weight.t(), beta=1) + self.vae2llm.bias

    def _image_block(self, body: torch.Tensor, gen: bool) -> tuple[torch.Tensor, torch.Tensor]:
        vs, ve = self._embed([self.tokens.vision_start, self.tokens.vision_end])
        x = torch.cat([vs[None], body.to(self.dtype), ve[None]])
        mask = torch.zeros(x.shape[0], dtype=torch.bool)
        if gen:
            mask[1:-1] = True
        return x, mask

    @torch.inference_mode()
    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        try:
            walk = BagelWalk(graph_walk)
        except ValueError:
            raise ValueError(f"LLM node: unknown walk {graph_walk!r}") from None
        ctx = Ctx.from_tensor(inputs["ctx"][0])
        if walk is BagelWalk.PREFILL_TEXT:
            return self._prefill_text(inputs, ctx)
        if walk is BagelWalk.PREFILL_VIT:
            return self._prefill_image(self._image_block(inputs["vit_embeds"][0], gen=False), ctx)
        if walk is BagelWalk.PREFILL_VAE:
            lat = inputs["vae_latents"][0]
            h, w = int(inputs["vae_latents"][1][0]), int(inputs["vae_latents"][1][1])
            return self._prefill_image(self._image_block(self.latent_tokens(lat, 0.0, h, w), gen=True), ctx)
        if walk is BagelWalk.DECODE:
            return self._decode(fwd_info, inputs, ctx)
        return self._flow(walk, fwd_info, inputs, ctx)  # IMAGE_GEN, IMAGE_GEN_CFG

    def _prefill_text(self, inputs, ctx: Ctx) -> NodeInputs:
        ids = [self.tokens.im_start, *inputs["text_ids"][0].reshape(-1).tolist(), self.tokens.im_end]
        x = self._embed(ids)
        n = len(ids)
        pos = torch.arange(ctx.rope, ctx.rope + n)
        seqs = [KVSequence("LLM", n, QueryMode.CAUSAL_APPEND)]
        if ctx.write_img:  # the text-only context of the cfg_img branch, at its own positions
            seqs.append(KVSequence("LLM_cfg_img", n, QueryMode.CAUSAL_APPEND))
            x, pos = torch.cat([x, x]), torch.cat([pos, torch.arange(ctx.img_rope, ctx.img_rope + n)])
        gen = torch.zeros(x.shape[0], dtype=torch.bool)
        return NodeInputs({"x": x, "gen": gen, "pos": pos}, sequences=seqs, args=_PREFILL)

    @staticmethod
    def _prefill_image(block: tuple[torch.Tensor, torch.Tensor], ctx: Ctx) -> NodeInputs:
        x, gen = block
        pos = torch.full((x.shape[0],), ctx.rope, dtype=torch.long)
        return NodeInputs({"x": x, "gen": gen, "pos": pos},
                          sequences=[KVSequence("LLM", x.shape[0], QueryMode.BLOCK_APPEND)], args=_PREFILL)

    def _decode(self, fwd_info, inputs, ctx: Ctx) -> NodeInputs:
        tok = int(inputs["token"][0].reshape(-1)[0])
        step = fwd_info.iteration[-1] if fwd_info.iteration else 0
        pos = torch.tensor([ctx.rope + fwd_info.cache_len - ctx.length])
        sp = fwd_info.params.sampling  # a BagelRequest's (BagelModel.parse_request)
        stop = stop_token_set(sp, (self.tokens.im_end,))
        return NodeInputs({"x": self._embed([tok]), "gen": torch.zeros(1, dtype=torch.bool), "pos": pos},
                          sequences=[KVSequence("LLM", 1, QueryMode.CAUSAL_APPEND)],
                          args=_Decode(sp, step, stop))

    def _flow(self, walk: BagelWalk, fwd_info, inputs, ctx: Ctx) -> NodeInputs:
        branch = _BRANCH[fwd_info.node]
        fs = fwd_info.params.flow
        i = int(inputs["time_index"][0].reshape(-1)[0])
        ts, dts = timestep_schedule(fs.num_timesteps, fs.timestep_shift)
        lat = inputs["latents"][0]
        single, last = walk is BagelWalk.IMAGE_GEN, i + 1 >= fs.num_steps
        active = branch == "main" or (
            fs.branch_active(branch, ts[i]) and not (ctx.text_alias if branch == "cfg_text" else ctx.img_alias))
        if not active:  # guidance off at this step (or identical to the main branch): no tokens
            e = torch.zeros(0, self.vae2llm.out_features, dtype=self.dtype)
            return NodeInputs({"x": e, "gen": torch.zeros(0, dtype=torch.bool), "pos": torch.zeros(0, dtype=torch.long)},
                              sequences=[], args=_Flow(branch, single, i, dts[i], last, None))
        # each guidance branch makes the same block (two small products): prepare_inputs keeps no state
        x, gen = self._image_block(self.latent_tokens(lat, ts[i], ctx.lat_h, ctx.lat_w), gen=True)
        n = x.shape[0]
        if branch == "main":
            seq, rope = KVSequence("LLM", n, QueryMode.READ_ONLY), ctx.rope
        elif branch == "cfg_text":  # the main context before the prompt text: a fork sharing its pages
            fork = ("LLM", ctx.text_len) if ctx.text_len else None
            seq, rope = KVSequence("LLM_cfg_text", n, QueryMode.READ_ONLY, fork), ctx.text_rope
        else:
            seq, rope = KVSequence("LLM_cfg_img", n, QueryMode.READ_ONLY), ctx.img_rope
        return NodeInputs({"x": x, "gen": gen, "pos": torch.full((n,), rope, dtype=torch.long)},
                          sequences=[seq], args=_Flow(branch, single, i, dts[i], last, lat))

    def forward(self, graph_walk, engine_inputs, x, gen, pos):
        ei = engine_inputs
        ei.positions = pos
        hidden = self.language_model(None, ei, gen_mask=gen, inputs_embeds=x) if x.shape[0] else x
        pieces = ei.token_splits(hidden)
        args = ei.args  # per row: _PREFILL, a _Decode or a _Flow
        out: dict[str, list[torch.Tensor]] = {k: [_EMPTY] * len(args) for k in _OUTPUTS}
        flow_rows = [r for r, a in enumerate(args) if type(a) is _Flow and a.latents is not None]
        if flow_rows:  # one llm2vae over every flow query's latent tokens
            vs = self.llm2vae(torch.cat([pieces[r][1:-1] for r in flow_rows])).float()
            vs = torch.split(vs, [pieces[r].shape[0] - 2 for r in flow_rows])
            for r, v in zip(flow_rows, vs):
                f: _Flow = args[r]
                if f.single:  # no guidance walk: take the Euler step here
                    out["latents"][r] = f.latents - v * f.dt
                    out["time_index"][r] = torch.tensor(f.i + 1)
                    out["stop"][r] = torch.tensor(f.last)
                elif f.branch == "main":
                    out["v_main"][r] = v
                    out["latents"][r] = f.latents
                    out["time_index"][r] = torch.tensor(f.i)
                else:
                    out[f"v_{f.branch}"][r] = v
        dec_rows = [r for r, a in enumerate(args) if type(a) is _Decode]
        if dec_rows:
            last = torch.stack([pieces[r][-1] for r in dec_rows])
            logits = self.language_model.compute_logits(last)
            decs: list[_Decode] = [args[r] for r in dec_rows]
            toks = sample(logits, [d.sampling for d in decs], None, [d.step for d in decs]).cpu()
            for j, (r, d) in enumerate(zip(dec_rows, decs)):
                tok = toks[j:j + 1].clone()
                out["token"][r] = tok
                out["text"][r] = tok
                out["stop"][r] = generation_finish(int(tok), d.step, d.sampling, d.stop_ids)
        return out


class CombineCFG(NodeSubmodule):
    """Joins the three branches: the reference's guidance combination and renormalisation, then the
    Euler step; stops the loop after the request's last step."""

    def forward(self, graph_walk, engine_inputs, v_main, v_cfg_text, v_cfg_img, latents, time_index, ctx):
        ei = engine_inputs
        cols = {n: ei.split(n, t) for n, t in (("v_main", v_main), ("v_cfg_text", v_cfg_text),
                                                 ("v_cfg_img", v_cfg_img), ("latents", latents),
                                                 ("time_index", time_index), ("ctx", ctx))}
        out: dict[str, list[torch.Tensor]] = {"latents": [], "time_index": [], "stop": []}
        for r, info in enumerate(ei.infos):
            c = Ctx.from_tensor(cols["ctx"][r])
            fs = info.params.flow
            i = int(cols["time_index"][r].reshape(-1)[0])
            ts, dts = timestep_schedule(fs.num_timesteps, fs.timestep_shift)
            s_text, s_img = fs.scales_at(ts[i])
            v = cols["v_main"][r]
            v_text = v if c.text_alias else (cols["v_cfg_text"][r] if cols["v_cfg_text"][r].numel() else None)
            v_img = v if c.img_alias else (cols["v_cfg_img"][r] if cols["v_cfg_img"][r].numel() else None)
            v = cfg_combine(v, v_text, v_img, s_text, s_img, fs.cfg_renorm_type, fs.cfg_renorm_min)
            out["latents"].append(cols["latents"][r] - v * dts[i])
            out["time_index"].append(torch.tensor(i + 1))
            out["stop"].append(torch.tensor(i + 1 >= fs.num_steps))
        return out


class ViTNode(NodeSubmodule):
    """SigLIP + connector + position embedding: an input image (uint8 ``[H, W, 3]``, resized and
    normalised here: ``InputImageTransforms.vit``) -> LLM tokens."""

    def __init__(self, vit: nn.Module, transforms: InputImageTransforms) -> None:
        super().__init__()
        self.vit, self.transforms = vit, transforms

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        return NodeInputs(args=self.transforms.vit(inputs["image"][0]))  # the image, resized and normalised

    def forward(self, graph_walk, engine_inputs, **_):
        return {"vit_embeds": list(self.vit(list(engine_inputs.args)))}


class VAEEncoderNode(NodeSubmodule):
    """FLUX VAE (posterior mean) + 2x2 patchify: an input image (uint8 ``[H, W, 3]``, resized and
    scaled to [-1, 1] here: ``InputImageTransforms.vae``) -> latent tokens ``[h*w, p*p*C]`` and the
    grid ``(h, w)``."""

    def __init__(self, vae: nn.Module, patch: int, transforms: InputImageTransforms) -> None:
        super().__init__()
        self.vae, self.patch, self.transforms = vae, patch, transforms

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        return NodeInputs(args=self.transforms.vae(inputs["image"][0]))  # the image, resized and scaled

    def forward(self, graph_walk, engine_inputs, **_):
        from mstar.models.bagel.vae import patchify_latents

        out = []
        for img in engine_inputs.args:  # sizes differ between requests: one call each
            lat = self.vae.encode(img[None].float())[0]
            tokens = patchify_latents(lat, self.patch)
            h, w = lat.shape[1] // self.patch, lat.shape[2] // self.patch
            out.append([tokens, torch.tensor([h, w])])
        return {"vae_latents": out}


class VAEDecoderNode(NodeSubmodule):
    """Unpatchify + FLUX VAE decode: latent tokens -> an RGB image ``uint8 [H, W, 3]`` (or, with
    ``output_type="latent"``, the latent tokens ``[h*w, p*p*C]`` themselves)."""

    def __init__(self, vae: nn.Module, patch: int, channels: int) -> None:
        super().__init__()
        self.vae, self.patch, self.channels = vae, patch, channels

    def prepare_inputs(self, graph_walk, fwd_info, inputs):
        c = Ctx.from_tensor(inputs["ctx"][0])
        # the latent tokens, their grid and whether to answer them undecoded
        return NodeInputs(args=(inputs["latents"][0], (c.lat_h, c.lat_w), fwd_info.params.latent_out))

    def forward(self, graph_walk, engine_inputs, **_):
        from mstar.models.bagel.vae import unpatchify_latents

        out = []
        for lat, (h, w), raw in engine_inputs.args:
            if raw:  # output_type="latent": the final latent tokens, no decode (as diffusers pipelines)
                out.append(lat.float().clone())
                continue
            z = unpatchify_latents(lat.float(), h, w, self.patch, self.channels)
            img = self.vae.decode(z[None])[0]
            out.append(((img * 0.5 + 0.5).clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).contiguous())
        return {"image_output": out}
