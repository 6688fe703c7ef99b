"""Qwen3-Omni's nodes (see ``graph.py`` for the walks they serve):

* ``audio_encoder``, ``vision_encoder``: transformers' audio and vision towers over the request's
  clips / images (``encoder_nodes.py``);
* ``Thinker`` (``ThinkerNode``): the MoE thinker over the paged cache (placeholders replaced by the
  towers' embeddings, deepstack features, M-RoPE positions); samples text tokens and, in the
  audio-out walks, streams per fed position ``[n, 2, H]`` = (input embedding, ``accept_hidden_layer``
  output);
* ``Talker`` (``TalkerNode``): the talker over its own paged cache. ``talker_prefill`` reads the prompt
  block and prefills the user turn + 8 assistant positions; each ``talker_decode`` iteration adds one
  position (``codec_sum`` of the previous frame + the next text: a streamed token's projection, then
  ``tts_eos`` once, then ``tts_pad``) and samples the frame's layer-0 code;
* ``code_predictor``, ``frame_assembler``, ``Code2Wav``: the nodes after the Talker, over codec codes
  and frames (``codec_nodes.py``).

Per-request sampling comes from the request's params (``model.py``): ``sampling`` (thinker),
``talker_sampling``, ``code_predictor_sampling``; ``voice`` picks the speaker.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mstar.layers.sampling import SamplingParams, request_sampling, sample
from mstar.model.decode import ParamsMemo, generation_done, stop_token_set
from mstar.model.submodule import EngineInputs, ForwardInfo, KVSpec, NodeInputs, NodeSubmodule
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.prompt import OmniTokenIds, assistant_start, multimodal_mask, user_positions
from mstar.models.qwen3_omni.talker import TalkerLM, empty_frame_cache
from mstar.models.qwen3_omni.thinker import ThinkerLM, mrope_positions

__all__ = ["PREDICTOR_SAMPLING", "TALKER_SAMPLING", "THINKER_SAMPLING", "TalkerNode", "ThinkerNode",
           "omni_token_ids", "predictor_sampling", "talker_sampling", "vision_layout"]

THINKER_SAMPLING: Mapping[str, Any] = {"temperature": 0.0, "max_tokens": 256}
TALKER_SAMPLING: Mapping[str, Any] = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
                                      "max_tokens": 4096}
PREDICTOR_SAMPLING: Mapping[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 0.8}


def omni_token_ids(cfg: Qwen3OmniConfig) -> OmniTokenIds:
    """The prompts' token and codec ids, as read from the checkpoint."""
    return cfg.tokens


def talker_sampling(params: Mapping[str, Any]) -> SamplingParams:
    return request_sampling({"sampling": params.get("talker_sampling")}, TALKER_SAMPLING)


def predictor_sampling(params: Mapping[str, Any], talker: SamplingParams | None = None) -> SamplingParams:
    """The request's ``code_predictor_sampling``; greedy when the talker is greedy and none is given
    (the reference mirrors the talker's ``do_sample``); a seeded talker seeds it too (talker seed + 1:
    its draws must not reuse the talker's noise at the same step) unless it has its own seed.
    ``talker``: ``talker_sampling(params)`` where the caller has it."""
    given = params.get("code_predictor_sampling")
    talker = talker or talker_sampling(params)
    if given is None and talker.greedy:
        return SamplingParams(temperature=0.0)
    defaults = {**PREDICTOR_SAMPLING, "seed": None if talker.seed is None else talker.seed + 1}
    return request_sampling({"sampling": given}, defaults)


_FLAGS = (torch.tensor(False), torch.tensor(True))  # shared by every row: flags are read, never written


def _bool(value: bool) -> torch.Tensor:
    return _FLAGS[bool(value)]


# -- Thinker -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ThinkerRequest:
    """One request's share of a Thinker forward beyond its token ids."""

    media: list[tuple[torch.Tensor, torch.Tensor]]  # (placeholder rows, tower embeddings) replacing them
    deepstack: tuple[torch.Tensor, torch.Tensor] | None  # (image rows, [layers, n, H]) added after layers
    positions: torch.Tensor | None  # [3, n] M-RoPE position ids of the new tokens (None: a decode token)
    delta: int  # M-RoPE position - cache offset of every token after the prompt (a decode token's position)
    prompt: torch.Tensor | None = None  # a prefill's whole prompt (its leading tokens may come cached)


class ThinkerNode(NodeSubmodule):
    """Prefill (``input_ids``; with ``audio_embeds`` / ``image_embeds``, ``deepstack``,
    ``image_grid_thw`` after the towers) and decode (``token``, ``seen``, ``rope_delta``) of the thinker;
    outputs ``token``, ``text`` (the same id, for the client), ``stop``, ``seen`` (prompt + generated
    ids when the request has a repetition penalty, else empty), ``rope_delta`` and ``thinker_states``
    (a list of items per request)."""

    def __init__(self, lm: ThinkerLM, cfg: Qwen3OmniConfig) -> None:
        super().__init__()
        self.lm = lm
        c = cfg.thinker
        self.kv_spec = KVSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, lm.lm_head.weight.dtype)
        self.accept_layer = cfg.talker.accept_hidden_layer
        self.eos_ids = (cfg.tokens.im_end,)
        self.tokens = cfg.tokens
        self.vision = vision_layout(cfg)
        self._sampling = ParamsMemo(self._build_sampling)

    def _build_sampling(self, params: Mapping[str, Any]) -> tuple[SamplingParams, frozenset[int]]:
        sp = request_sampling(params, THINKER_SAMPLING)
        return sp, stop_token_set(sp, self.eos_ids)

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        sp, stop_ids = self._sampling(fwd_info.params)
        penalised = sp.repetition_penalty != 1.0
        if "input_ids" in inputs:
            ids, step = inputs["input_ids"][0].reshape(-1).to(torch.long), 0
            req, seen = self._prefill_request(ids, inputs), ids if penalised else None
        else:
            ids, step = inputs["token"][0].reshape(-1).to(torch.long), fwd_info.iteration[-1] + 1
            req = _ThinkerRequest([], None, None, int(inputs["rope_delta"][0]))
            seen = inputs["seen"][0].reshape(-1).to(torch.long) if penalised else None
        if ids.numel() == 0:
            raise ValueError("the Thinker got no tokens")
        return NodeInputs(tensor_inputs={"ids": ids}, num_tokens=ids.numel(),
                          extras={"sampling": sp, "step": step, "stop_ids": stop_ids,
                                  "stream": not graph_walk.endswith("_text"), "req": req, "seen": seen},
                          prefix_ids=self._reusable(ids) if step == 0 else None, token_inputs=("ids",))

    def _reusable(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt's tokens before its first audio / image / video placeholder: their KV depends on
        the ids alone (sequential positions), so a later prompt that starts the same (the system
        prompt) may reuse their cached blocks; a placeholder's KV depends on its media, so nothing
        from the first one on is shared."""
        t = self.tokens
        media = ((ids == t.audio) | (ids == t.image) | (ids == t.video)).nonzero()
        return ids[:int(media[0])] if media.numel() else ids

    def _prefill_request(self, ids: torch.Tensor, inputs: Mapping[str, list]) -> _ThinkerRequest:
        media, deepstack, grids = [], None, None
        for name, token in (("audio_embeds", self.tokens.audio), ("image_embeds", self.tokens.image)):
            if name in inputs:  # the tower's rows replace the placeholders, in order
                rows, values = (ids == token).nonzero().reshape(-1), inputs[name][0]
                if rows.numel() != values.shape[0]:
                    raise ValueError(f"the prompt has {rows.numel()} {name.split('_')[0]} placeholders, its "
                                     f"inputs give {values.shape[0]} embeddings")
                media.append((rows, values))
        if "image_grid_thw" in inputs:
            grids = inputs["image_grid_thw"][0].reshape(-1, 3)
            deepstack = (media[-1][0], inputs["deepstack"][0])
        positions, delta = mrope_positions(ids, grids, self.tokens.image, *self.vision)
        return _ThinkerRequest(media, deepstack, positions, delta, ids)

    @staticmethod
    def _cached(ei: EngineInputs) -> list[int]:
        """Per request, the leading prompt tokens whose KV came from the prefix cache (not computed)."""
        return [0 if req.positions is None else req.positions.shape[1] - n
                for req, n in zip(ei.extras["req"], ei.num_tokens)]

    @staticmethod
    def _positions(ei: EngineInputs) -> torch.Tensor:
        """The batch's ``[3, tokens]`` M-RoPE position ids: a prefill's from its request, a decode token's
        its cache offset (``ei.positions``) + the request's delta on all three axes."""
        reqs = ei.extras["req"]
        if all(r.positions is None for r in reqs):  # decode tokens only: one add for the batch
            delta = torch.tensor([r.delta for r in reqs])
            return (ei.positions.view(-1) + delta).view(1, -1).expand(3, -1)
        parts, start = [], 0
        for r, n in zip(reqs, ei.num_tokens):
            if r.positions is None:
                parts.append((ei.positions[start:start + n] + r.delta).view(1, -1).expand(3, -1))
            else:
                parts.append(r.positions[:, r.positions.shape[1] - n:])
            start += n
        return torch.cat(parts, dim=1)

    def continue_batch(self, graph_walk: str | None, engine_inputs: EngineInputs, tensors: Mapping[str, torch.Tensor],
                       outputs: Mapping[str, list[Any]]) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]] | None:
        """A decode step's next batch (what ``prepare_inputs`` makes of the fed-back ``token`` and
        ``rope_delta``): each row's new token, its step one further; not with a repetition penalty
        (its seen tokens grow) or media (a prefill's)."""
        x = engine_inputs.extras
        tokens = outputs.get("token")
        if tokens is None or any(s is not None for s in x["seen"]) \
                or any(r.media or r.deepstack is not None for r in x["req"]):
            return None
        ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0].reshape(-1)
        if ids.dtype != torch.long or ids.shape[0] != len(tokens):
            return None
        reqs = [r if r.positions is None else _ThinkerRequest([], None, None, r.delta) for r in x["req"]]
        return {"ids": ids}, {"sampling": x["sampling"], "step": [s + 1 for s in x["step"]],
                              "stop_ids": x["stop_ids"], "stream": x["stream"], "req": reqs, "seen": x["seen"]}

    def _embed(self, ids: torch.Tensor, ei: EngineInputs) -> torch.Tensor:
        embeds = self.lm.embed(ids)
        for start, skip, req in zip(_starts(ei), self._cached(ei), ei.extras["req"]):
            for rows, values in req.media:  # placeholders are never cached (``_reusable``)
                embeds = embeds.index_copy(0, rows.to(embeds.device) + start - skip, values.to(embeds))
        return embeds

    def _deepstack(self, ei: EngineInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per deepstack layer, (batch rows, features) of every request with images."""
        parts = [(rows + start - skip, feats) for start, skip, req in zip(_starts(ei), self._cached(ei),
                                                                         ei.extras["req"])
                 if req.deepstack is not None for rows, feats in [req.deepstack]]
        if not parts:
            return []
        layers = parts[0][1].shape[0]
        return [(torch.cat([r for r, _ in parts]), torch.cat([f[k] for _, f in parts])) for k in range(layers)]

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs,
                ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        ei = engine_inputs
        streams = any(ei.extras["stream"])
        embeds = self._embed(ids, ei)
        positions = self._positions(ei)
        out = self.lm(embeds, ei, capture=self.accept_layer if streams else None, mrope_positions=positions,
                      deepstack=self._deepstack(ei))
        last = out.hidden[ei.last_token_rows().to(out.hidden.device)]
        seen, sampling = ei.extras["seen"], ei.extras["sampling"]
        tokens = None
        if all(sp.greedy and sp.repetition_penalty == 1.0 for sp in sampling):  # ``sample``: the logits' argmax
            tokens = self.lm.lm_head.argmax(last)  # without writing the logits out (None: no such path)
        if tokens is None:
            tokens = sample(self.lm.lm_head(last), sampling, None if all(s is None for s in seen) else seen,
                            ei.extras["step"])
        tokens = tokens.cpu()
        states = torch.stack([embeds, out.captured], dim=1).cpu() if streams else None
        cached = self._cached(ei)
        result: dict[str, list] = {"token": [], "text": [], "stop": [], "thinker_states": [], "rope_delta": [],
                                   "seen": []}
        x = ei.extras
        # per row, views of one tensor for the batch: tokens, M-RoPE offsets
        ids, rows = tokens.tolist(), tokens.view(-1, 1).unbind(0)
        deltas = torch.tensor([r.delta for r in x["req"]]).view(-1, 1).unbind(0)
        for i, (start, n) in enumerate(zip(_starts(ei), ei.num_tokens)):
            tok = rows[i]
            result["token"].append(tok)
            result["text"].append(tok)
            done = generation_done(ids[i], x["step"][i], x["sampling"][i], x["stop_ids"][i])
            result["stop"].append(_bool(done))
            result["rope_delta"].append(deltas[i])
            # prompt + generated tokens, for the repetition penalty (empty when the request has none)
            result["seen"].append(torch.zeros(0, dtype=torch.long) if seen[i] is None
                                  else torch.cat([seen[i], tok]))
            result["thinker_states"].append([self._states(states[start:start + n], ei.extras["req"][i], cached[i])]
                                            if ei.extras["stream"][i] else [])
        return result

    def _states(self, computed: torch.Tensor, req: _ThinkerRequest, cached: int) -> torch.Tensor:
        """A prefill's ``[prompt, 2, H]`` states: its cached leading positions get their input
        embeddings (text: the embedding table) and zeros for the accepted layer's hidden state, which
        was not computed; the Talker reads hidden states only at media placeholders, never cached."""
        if not cached:
            return computed
        head = self.lm.embed(req.prompt[:cached].to(self.lm.lm_head.weight.device)).to(computed)
        return torch.cat([torch.stack([head, torch.zeros_like(head)], dim=1), computed])


def _starts(ei: EngineInputs) -> list[int]:
    """Each request's first row in the batch's flat token dimension."""
    return [0, *torch.tensor(ei.num_tokens).cumsum(0).tolist()[:-1]]


def vision_layout(cfg: Qwen3OmniConfig) -> tuple[int, int]:
    """(spatial merge size, position ids per second) of the M-RoPE image positions."""
    th = cfg.hf.get("thinker_config") or {}
    merge = (th.get("vision_config") or {}).get("spatial_merge_size", 2)
    return int(merge), int(th.get("position_id_per_seconds", 13))


# -- Talker --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PrefillRequest:
    """What one request's talker prefill projects: the thinker rows of its user positions (text or
    placeholder), the 3 assistant-header rows, and its speaker's codec id."""

    text_rows: torch.Tensor  # [U_text + 3, Ht] input embeddings: user text positions, then the header
    hidden_rows: torch.Tensor  # [U_mm, Ht] accepted-layer states at the user's media placeholders
    is_media: torch.Tensor  # bool [U]: which user positions take hidden_rows
    speaker: int
    positions: torch.Tensor  # [3, U + 8] M-RoPE position ids
    delta: int  # position - cache offset after the prompt (non-zero with images)


@dataclass(frozen=True)
class _DecodeRequest:
    codec_sum: torch.Tensor  # [1, H]
    text_row: torch.Tensor | None  # [1, Ht] the next streamed token's input embedding, or None
    tts: str  # "text", "eos" or "pad"
    position: int  # the M-RoPE position of all three sections


class TalkerNode(NodeSubmodule):
    """Prefill: ``thinker_states`` (prompt block), ``input_ids`` (and ``image_grid_thw`` with images)
    -> ``codec_sum`` (= E(codec_bos)), ``talker_seen`` (empty), ``talker_delta`` (M-RoPE offset).
    Decode: ``thinker_states``, ``codec_sum``, ``talker_seen``, ``talker_delta`` -> ``code0``,
    ``speak``, ``stop``, ``talker_seen``, and the code predictor's initial values ``talker_hidden``,
    ``code``, ``cp_cache``, ``cp_sum``."""

    def __init__(self, lm: TalkerLM, cfg: Qwen3OmniConfig, tts_rows: torch.Tensor) -> None:
        super().__init__()
        self.lm = lm
        c = cfg.talker
        self.kv_spec = KVSpec(c.text.num_hidden_layers, c.text.num_key_value_heads, c.text.head_dim,
                              lm.codec_head.weight.dtype)
        self.ids = omni_token_ids(cfg)
        self.cp_config = c.code_predictor
        self.vision = vision_layout(cfg)
        # the thinker's input embeddings of tts_bos, tts_eos, tts_pad [3, Ht] (projected in each forward)
        self.register_buffer("tts_rows", tts_rows.detach().clone(), persistent=False)
        self._sampling = ParamsMemo(talker_sampling)
        self._empty_cp_cache: dict[torch.dtype, torch.Tensor] = {}  # the code predictor's frame cache at step 0

    # -- inputs ---------------------------------------------------------------------------------------
    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        items = inputs["thinker_states"]
        if graph_walk.startswith("talker_prefill"):
            grids = inputs["image_grid_thw"][0].reshape(-1, 3) if "image_grid_thw" in inputs else None
            req, reusable = self._prefill_request(inputs["input_ids"][0].reshape(-1), items, grids, fwd_info.params)
            n = int(req.is_media.numel()) + 8
            return NodeInputs(num_tokens=n, extras={"req": req, "sampling": None, "seen": None, "step": 0},
                              prefix_ids=reusable)
        step = fwd_info.iteration[-1]
        chunk = fwd_info.stream_chunks.get("thinker_states") or {"start": 0}
        if items:
            row, tts = items[0][:, 0], "text"
        else:  # the thinker ended: tts_eos right after its last streamed token, then pads
            row, tts = None, "eos" if step == int(chunk["start"]) - 1 else "pad"
        position = fwd_info.cache_len + int(inputs["talker_delta"][0])
        codec_sum, seen = inputs["codec_sum"][0], inputs["talker_seen"][0]  # [1, H] and [n] long as made here
        if codec_sum.dim() != 2:
            codec_sum = codec_sum.reshape(1, -1)
        if seen.dim() != 1 or seen.dtype != torch.long:
            seen = seen.reshape(-1).to(torch.long)
        req = _DecodeRequest(codec_sum, row, tts, position)
        return NodeInputs(num_tokens=1, extras={"req": req, "sampling": self._sampling(fwd_info.params),
                                                "seen": seen, "step": step})

    def _prefill_request(self, prompt: torch.Tensor, items: list, grids: torch.Tensor | None,
                         params: Mapping[str, Any]) -> tuple[_PrefillRequest, torch.Tensor]:
        """The request's prefill rows and the ids of its leading rows whose KV the prefix cache may
        share (``_reusable``)."""
        if len(items) != 1 or items[0].shape[0] != prompt.numel():
            raise ValueError(f"the Talker prefill needs the prompt's thinker states ({prompt.numel()} positions)")
        states = items[0]
        if grids is None:
            fast = self._text_prefill_request(prompt.tolist(), states, params)
            if fast is not None:
                return fast
        start = assistant_start(prompt, self.ids)
        if prompt.numel() - start != 3:
            raise ValueError("the prompt must end with '<|im_start|>assistant\\n' for audio output")
        users = user_positions(prompt, self.ids)
        media = multimodal_mask(prompt, self.ids)[users]
        text_pos = torch.cat([users[~media], torch.arange(start, start + 3)])
        speaker = self.ids.speaker_id(str(params.get("voice") or "ethan"))
        talker_ids = torch.cat([prompt[users], torch.full((9,), self.ids.tts_pad)])  # what RoPE is computed from
        positions, delta = mrope_positions(talker_ids, grids, self.ids.image, *self.vision)
        req = _PrefillRequest(states[text_pos, 0], states[users[media], 1], media, speaker, positions[:, :-1], delta)
        return req, self._reusable(prompt[users], media, prompt[start:start + 3], speaker)

    def _text_prefill_request(self, ids: list[int], states: torch.Tensor, params: Mapping[str, Any]
                              ) -> tuple[_PrefillRequest, torch.Tensor] | None:
        """``_prefill_request`` of a prompt without media placeholders, over the ids as a list (the
        same values in a few tensor operations instead of some twenty: ~0.1 ms a request); None for a
        prompt with placeholders or without the assistant header at its end (the general path decides)."""
        t = self.ids
        n = len(ids)
        if n < 3 or ids[-3] != t.im_start or ids[-2] != t.assistant or not {t.audio, t.image, t.video}.isdisjoint(ids):
            return None
        users, latest = [], 0  # user_positions: the role after the latest <|im_start|> (or after position 0)
        for i, token in enumerate(ids):
            if token == t.im_start:
                latest = i
            if ids[min(latest + 1, n - 1)] == t.user:
                users.append(i)
        speaker = t.speaker_id(str(params.get("voice") or "ethan"))
        rows = torch.tensor([*users, n - 3, n - 2, n - 1])
        u = len(users)
        req = _PrefillRequest(states[rows, 0], states.new_empty(0, states.shape[-1]), torch.zeros(u, dtype=torch.bool),
                              speaker, torch.arange(u + 8).expand(3, -1), 0)
        user_ids = [ids[i] for i in users]
        codec = [t.codec_nothink, t.codec_think_bos, t.codec_think_eos, speaker, t.codec_pad]
        return req, torch.tensor([*user_ids, *ids[-3:], *(-1 - c for c in codec)])

    def _reusable(self, user_ids: torch.Tensor, media: torch.Tensor, header: torch.Tensor, speaker: int) -> torch.Tensor:
        """The leading talker prompt rows whose KV depends on ids alone, as the prefix cache's key: a
        user text row is the text projection of its id's embedding, so up to the first media placeholder
        (whose row depends on the media) the ids name the rows; with no media, the 8 assistant rows
        follow: the header's 3 ids, then one negative key per tts + codec row (-1 - its codec id: the
        speaker's among them), which no token id takes."""
        if media.any():
            return user_ids[:int(media.nonzero()[0])]
        i = self.ids
        codec = torch.tensor([i.codec_nothink, i.codec_think_bos, i.codec_think_eos, speaker, i.codec_pad])
        return torch.cat([user_ids, header, -1 - codec])

    # -- forward --------------------------------------------------------------------------------------
    @staticmethod
    def _cached(ei: EngineInputs) -> list[int]:
        """Per request, the leading prefill rows whose KV came from the prefix cache (0 for decode rows)."""
        return [req.positions.shape[1] - n if isinstance(req, _PrefillRequest) else 0
                for req, n in zip(ei.extras["req"], ei.num_tokens)]

    def _project_text(self, reqs: list, cached: list[int]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The text projection of ``tts_bos/eos/pad`` [3, H] and of each request's text rows (None for
        a decode step without a streamed token; a prefill's rows from the cache are not projected: they
        are its first text rows, ``_reusable`` stops at the first media row): in one call where a row's
        result does not depend on the others (the prepacked panel kernel), else one call per request,
        as the reference makes it."""
        w, proj = self.lm.codec_head.weight, self.lm.text_projection
        rows = [r.text_rows[skip:] if isinstance(r, _PrefillRequest) else r.text_row for r, skip in zip(reqs, cached)]
        given = [x for x in rows if x is not None]
        tts_rows = self.tts_rows.to(w)
        if not proj.row_invariant(tts_rows):
            return proj(tts_rows), [None if x is None else proj(x.to(w)) for x in rows]
        projected = proj(torch.cat([self.tts_rows, *given]).to(w))
        pieces = iter(projected.split([self.tts_rows.shape[0]] + [x.shape[0] for x in given]))
        tts = next(pieces)
        return tts, [None if x is None else next(pieces) for x in rows]

    def _prefill_embeds(self, req: _PrefillRequest, tts: torch.Tensor, text: torch.Tensor, cached: int) -> torch.Tensor:
        """The prefill's input rows after its ``cached`` first ones (``text``: the projected text rows
        after those)."""
        lm, ids = self.lm, self.ids
        w = lm.codec_head.weight
        skipped = req.text_rows.shape[0] - text.shape[0]
        if skipped:  # rows the forward does not compute: stand-ins, dropped below
            text = torch.cat([text.new_zeros(skipped, text.shape[-1]), text])
        n_user = req.is_media.numel()
        user = text.new_empty(n_user, text.shape[-1])
        user[~req.is_media] = text[:-3]
        if req.hidden_rows.shape[0]:
            user[req.is_media] = lm.hidden_projection(req.hidden_rows.to(w))
        header = torch.cat([text[-3:], tts[2:3].expand(4, -1), tts[0:1]])  # 3 rows, tts_pad x4, tts_bos
        codec = lm.codec_embed(torch.tensor([ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos,
                                             req.speaker, ids.codec_pad]))
        return torch.cat([user, header + torch.cat([codec.new_zeros(3, codec.shape[-1]), codec])])[cached:]

    @staticmethod
    def _decode_text(req: _DecodeRequest, tts: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
        if text is None:  # no streamed token: tts_eos right after the thinker's last one, then tts_pad
            text = tts[1:2] if req.tts == "eos" else tts[2:3]
        return text

    @staticmethod
    def _decode_embed(req: _DecodeRequest, text: torch.Tensor) -> torch.Tensor:
        return req.codec_sum.to(text) + text

    def _embeds(self, reqs: list, tts: torch.Tensor, texts: list, cached: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The input embeddings ``[N, H]`` and M-RoPE positions ``[3, N]`` of the batch's rows; a batch
        of decode rows in one add (each element rounds as in a row's own add)."""
        if all(isinstance(r, _DecodeRequest) for r in reqs):
            text = torch.cat([self._decode_text(r, tts, t) for r, t in zip(reqs, texts)])
            embeds = torch.cat([r.codec_sum for r in reqs]).to(text) + text
            return embeds, torch.tensor([r.position for r in reqs]).expand(3, -1)
        embeds = torch.cat([self._prefill_embeds(r, tts, t, skip) if isinstance(r, _PrefillRequest) else
                            self._decode_embed(r, self._decode_text(r, tts, t)) for r, t, skip in zip(reqs, texts, cached)])
        positions = torch.cat([r.positions[:, skip:] if isinstance(r, _PrefillRequest) else torch.full((3, 1), r.position)
                               for r, skip in zip(reqs, cached)], dim=1)
        return embeds, positions

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs, **_: torch.Tensor) -> dict[str, list]:
        ei = engine_inputs
        reqs = ei.extras["req"]
        cached = self._cached(ei)
        tts, texts = self._project_text(reqs, cached)
        embeds, positions = self._embeds(reqs, tts, texts, cached)
        hidden = self.lm(embeds, ei, mrope_positions=positions).hidden
        last = hidden[ei.last_token_rows().to(hidden.device)]
        decode_rows = [i for i, r in enumerate(ei.extras["req"]) if isinstance(r, _DecodeRequest)]
        decoded = self._decode_values(last, ei, decode_rows)
        bos = self.lm.codec_embed(torch.tensor([self.ids.codec_bos]))
        out: dict[str, list] = {k: [] for k in ("codec_sum", "talker_seen", "talker_delta", "code0", "speak",
                                                "stop", "talker_hidden", "code", "cp_cache", "cp_sum")}
        for i, req in enumerate(ei.extras["req"]):
            if isinstance(req, _PrefillRequest):
                self._prefill_outputs(out, bos, req.delta)
            else:
                self._decode_outputs(out, ei, i, *next(decoded))
        return out

    def _decode_values(self, last: torch.Tensor, ei: EngineInputs, rows: list[int]
                       ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per decode row, in order: (code, the code as a ``[1]`` tensor, the row's hidden state
        ``[1, H]``, the code's embedding ``[1, H]``), each tensor a row of one tensor for the batch
        (one sampling, one copy of the hidden states, one embedding lookup)."""
        if not rows:
            return iter(())
        hidden = last[rows]  # a copy: no view of the forward's activations is kept
        logits = self.lm.logits(hidden)
        no_eos = [r for r, i in enumerate(rows) if ei.extras["sampling"][i].ignore_eos]
        if no_eos:  # ignore_eos: codec EOS is suppressed as well, the talker runs to its max_tokens
            logits[no_eos, self.ids.codec_eos] = float("-inf")
        picked = sample(logits, [ei.extras["sampling"][i] for i in rows],
                        [ei.extras["seen"][i] for i in rows], [ei.extras["step"][i] for i in rows]).cpu().to(torch.long)
        embedded = self.lm.codec_embed(picked)
        return zip(picked.tolist(), picked.view(-1, 1).unbind(0), hidden.split(1), embedded.split(1))

    def _prefill_outputs(self, out: dict[str, list], bos: torch.Tensor, delta: int) -> None:
        out["codec_sum"].append(bos.clone())
        out["talker_seen"].append(torch.zeros(0, dtype=torch.long))
        out["talker_delta"].append(torch.tensor([delta]))
        for name in ("code0", "speak", "stop", "talker_hidden", "code", "cp_cache", "cp_sum"):
            out[name].append(None)

    def _decode_outputs(self, out: dict[str, list], ei: EngineInputs, i: int, code: int, c0: torch.Tensor,
                        hidden: torch.Tensor, embedded: torch.Tensor) -> None:
        sp: SamplingParams = ei.extras["sampling"][i]
        last = code == self.ids.codec_eos or ei.extras["step"][i] + 1 >= sp.max_tokens
        # the EOS (or max) step's frame is computed but not streamed (speak false)
        out["codec_sum"].append(None)
        out["talker_delta"].append(None)
        out["talker_seen"].append(torch.cat([ei.extras["seen"][i], c0]))
        out["code0"].append(c0)
        out["speak"].append(_bool(not last))
        out["stop"].append(_bool(last))
        out["talker_hidden"].append(hidden)
        out["code"].append(c0)
        empty = self._empty_cp_cache.get(hidden.dtype)
        if empty is None:  # no elements, never written: one for every row
            empty = self._empty_cp_cache[hidden.dtype] = empty_frame_cache(self.cp_config, hidden.dtype)
        out["cp_cache"].append(empty)
        out["cp_sum"].append(embedded)
