"""Qwen3-Omni's ``Talker`` node (see ``graph.py`` for its walks, ``nodes.py`` for the Thinker's):
the talker over its own paged cache. ``talker_prefill`` reads the prompt block and prefills the user
turn + 8 assistant positions (its leading rows reused from the prefix cache when they repeat:
``TalkerNode._reusable``); each ``talker_decode`` iteration adds one position (``codec_sum`` of the
previous frame + the next text: a streamed token's projection, then ``tts_eos`` once, then
``tts_pad``) and samples the frame's layer-0 code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from mstar.layers.sampling import SamplingParams, sample
from mstar.model.submodule import EngineInputs, ForwardInfo, KVSpec, NodeInputs, NodeSubmodule
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.nodes import flag, omni_token_ids, vision_layout
from mstar.models.qwen3_omni.prompt import assistant_start, multimodal_mask, user_positions
from mstar.models.qwen3_omni.request import OmniRequest
from mstar.models.qwen3_omni.talker import TalkerLM, empty_frame_cache
from mstar.models.qwen3_omni.thinker import mrope_positions

__all__ = ["TalkerNode"]


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
    sampling: SamplingParams  # the OmniRequest's Talker sampling
    seen: torch.Tensor  # the codes so far (the repetition penalty's)
    step: int


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
        self._empty_cp_cache: dict[torch.dtype, torch.Tensor] = {}  # the code predictor's frame cache at step 0
        self._codec_rows: dict[tuple[int, int, int], torch.Tensor] = {}  # _assistant_codec
        self._code_keys: dict[int, torch.Tensor] = {}  # _negative_codes

    # -- inputs ---------------------------------------------------------------------------------------
    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        items = inputs["thinker_states"]
        if graph_walk.startswith("talker_prefill"):
            grids = inputs["image_grid_thw"][0].reshape(-1, 3) if "image_grid_thw" in inputs else None
            req, reusable = self._prefill_request(inputs["input_ids"][0].reshape(-1), items, grids, fwd_info.params)
            n = int(req.is_media.numel()) + 8
            return NodeInputs(num_tokens=n, args=req, prefix_ids=reusable)
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
        return NodeInputs(num_tokens=1, args=_DecodeRequest(codec_sum, row, tts, position, fwd_info.params.talker,
                                                             seen, step))

    def _prefill_request(self, prompt: torch.Tensor, items: list, grids: torch.Tensor | None,
                         params: OmniRequest) -> tuple[_PrefillRequest, torch.Tensor]:
        """The request's prefill rows and the ids of its leading rows whose KV the prefix cache may
        share (``_reusable``)."""
        if len(items) != 1 or items[0].shape[0] != prompt.numel():
            raise ValueError(f"the Talker prefill needs the prompt's thinker states ({prompt.numel()} positions)")
        states = items[0]
        if grids is None:
            fast = self._text_prefill_request(prompt.tolist(), states, params, prompt)
            if fast is not None:
                return fast
        start = assistant_start(prompt, self.ids)
        if prompt.numel() - start != 3:
            raise ValueError("the prompt must end with '<|im_start|>assistant\\n' for audio output")
        users = user_positions(prompt, self.ids)
        media = multimodal_mask(prompt, self.ids)[users]
        text_pos = torch.cat([users[~media], torch.arange(start, start + 3)])
        speaker = self.ids.speaker_id(params.voice)
        talker_ids = torch.cat([prompt[users], torch.full((9,), self.ids.tts_pad)])  # what RoPE is computed from
        positions, delta = mrope_positions(talker_ids, grids, self.ids.image, *self.vision)
        req = _PrefillRequest(states[text_pos, 0], states[users[media], 1], media, speaker, positions[:, :-1], delta)
        return req, self._reusable(prompt[users], media, prompt[start:start + 3], speaker)

    def _text_prefill_request(self, ids: list[int], states: torch.Tensor, params: OmniRequest,
                              prompt: torch.Tensor | None = None) -> tuple[_PrefillRequest, torch.Tensor] | None:
        """``_prefill_request`` of a prompt without media placeholders, over the ids as a list and the
        user turns as slices (the same values in a few tensor operations instead of some twenty);
        None for a prompt with placeholders or without the assistant header at its end (the general
        path decides). ``prompt``: the ids as a tensor (made from ``ids`` when not given)."""
        t = self.ids
        n = len(ids)
        if n < 3 or ids[-3] != t.im_start or ids[-2] != t.assistant or not {t.audio, t.image, t.video}.isdisjoint(ids):
            return None
        # user_positions: a position's role is the token after the latest <|im_start|> (after position 0
        # before the first one), so each turn from its <|im_start|> to the next is in or out as a whole
        starts = [i for i, token in enumerate(ids) if token == t.im_start]
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        turns = [(a, b) for a, b in zip(starts, [*starts[1:], n]) if ids[min(a + 1, n - 1)] == t.user]
        u = sum(b - a for a, b in turns)
        speaker = t.speaker_id(params.voice)
        prompt = torch.tensor(ids) if prompt is None else prompt.to(torch.long)
        text = torch.cat([*(states[a:b, 0] for a, b in turns), states[n - 3:, 0]])
        req = _PrefillRequest(text, states.new_empty(0, states.shape[-1]), torch.zeros(u, dtype=torch.bool),
                              speaker, torch.arange(u + 8).expand(3, -1), 0)
        return req, torch.cat([*(prompt[a:b] for a, b in turns), prompt[n - 3:], self._negative_codes(speaker)])

    def _negative_codes(self, speaker: int) -> torch.Tensor:
        """The prefix keys of the tts + codec rows (``_reusable``), kept per speaker."""
        key = self._code_keys.get(speaker)
        if key is None:
            key = self._code_keys[speaker] = -1 - torch.tensor(self._assistant_codes(speaker))
        return key

    def _reusable(self, user_ids: torch.Tensor, media: torch.Tensor, header: torch.Tensor, speaker: int) -> torch.Tensor:
        """The leading talker prompt rows whose KV depends on ids alone, as the prefix cache's key: a
        user text row is the text projection of its id's embedding, so up to the first media placeholder
        (whose row depends on the media) the ids name the rows; with no media, the 8 assistant rows
        follow: the header's 3 ids, then one negative key per tts + codec row (-1 - its codec id: the
        speaker's among them), which no token id takes."""
        if media.any():
            return user_ids[:int(media.nonzero()[0])]
        return torch.cat([user_ids, header, self._negative_codes(speaker)])

    def _assistant_codes(self, speaker: int) -> list[int]:
        """The codec ids added to the last 5 assistant rows (under tts_pad x4, tts_bos)."""
        i = self.ids
        return [i.codec_nothink, i.codec_think_bos, i.codec_think_eos, speaker, i.codec_pad]

    # -- forward --------------------------------------------------------------------------------------
    @staticmethod
    def _cached(ei: EngineInputs) -> list[int]:
        """Per request, the leading prefill rows whose KV came from the prefix cache (0 for decode rows)."""
        return [req.positions.shape[1] - n if isinstance(req, _PrefillRequest) else 0
                for req, n in zip(ei.args, ei.num_tokens)]

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
        lm = self.lm
        w = lm.codec_head.weight
        n_user = req.is_media.numel()
        if not req.hidden_rows.shape[0]:
            # no media: the projected user rows after the cached ones, then the 8 assistant rows, made
            # as below (header rows the cache holds: zero stand-ins, dropped; the codec rows added)
            k = text.shape[0]  # >= 3: every header row is computed (cached <= n_user)
            head = text[-3:] if k >= 3 else torch.cat([text.new_zeros(3 - k, text.shape[-1]), text])
            tail = torch.cat([head, tts[2:3].expand(4, -1), tts[0:1]]) + self._assistant_codec(req.speaker)
            return torch.cat([text[:-3], tail]) if k > 3 else tail[cached - n_user:]
        skipped = req.text_rows.shape[0] - text.shape[0]
        if skipped:  # rows the forward does not compute: stand-ins, dropped below
            text = torch.cat([text.new_zeros(skipped, text.shape[-1]), text])
        user = text.new_empty(n_user, text.shape[-1])
        user[~req.is_media] = text[:-3]
        if req.hidden_rows.shape[0]:
            user[req.is_media] = lm.hidden_projection(req.hidden_rows.to(w))
        header = torch.cat([text[-3:], tts[2:3].expand(4, -1), tts[0:1]])  # 3 rows, tts_pad x4, tts_bos
        return torch.cat([user, header + self._assistant_codec(req.speaker)])[cached:]

    def _assistant_codec(self, speaker: int) -> torch.Tensor:
        """``[8, H]``: zeros for the header's 3 text rows, then the codec embeddings of the last 5
        assistant rows (``_assistant_codes``), kept per speaker and codec-embedding version."""
        table = self.lm.model.codec_embedding.weight
        key = (speaker, table.data_ptr(), table._version)
        rows = self._codec_rows.get(key)
        if rows is None:
            codec = self.lm.codec_embed(torch.tensor(self._assistant_codes(speaker)))
            rows = torch.cat([codec.new_zeros(3, codec.shape[-1]), codec])
            if len(self._codec_rows) >= 64:  # speakers x weight versions seen; dropped wholesale when full
                self._codec_rows.clear()
            self._codec_rows[key] = rows
        return rows

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
        reqs: list[_PrefillRequest | _DecodeRequest] = ei.args
        cached = self._cached(ei)
        tts, texts = self._project_text(reqs, cached)
        embeds, positions = self._embeds(reqs, tts, texts, cached)
        hidden = self.lm(embeds, ei, mrope_positions=positions).hidden
        last = hidden[ei.last_token_rows().to(hidden.device)]
        decode_rows = [i for i, r in enumerate(reqs) if isinstance(r, _DecodeRequest)]
        decoded = self._decode_values(last, ei, decode_rows)
        bos = self.lm.codec_embed(torch.tensor([self.ids.codec_bos]))
        out: dict[str, list] = {k: [] for k in ("codec_sum", "talker_seen", "talker_delta", "code0", "speak",
                                                "stop", "talker_hidden", "code", "cp_cache", "cp_sum")}
        for i, req in enumerate(reqs):
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
        decs: list[_DecodeRequest] = [ei.args[i] for i in rows]
        no_eos = [r for r, d in enumerate(decs) if d.sampling.ignore_eos]
        if no_eos:  # ignore_eos: codec EOS is suppressed as well, the talker runs to its max_tokens
            logits[no_eos, self.ids.codec_eos] = float("-inf")
        picked = sample(logits, [d.sampling for d in decs], [d.seen for d in decs],
                        [d.step for d in decs]).cpu().to(torch.long)
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
        d: _DecodeRequest = ei.args[i]
        last = code == self.ids.codec_eos or d.step + 1 >= d.sampling.max_tokens
        # the EOS (or max) step's frame is computed but not streamed (speak false)
        out["codec_sum"].append(None)
        out["talker_delta"].append(None)
        out["talker_seen"].append(torch.cat([d.seen, c0]))
        out["code0"].append(c0)
        out["speak"].append(flag(not last))
        out["stop"].append(flag(last))
        out["talker_hidden"].append(hidden)
        out["code"].append(c0)
        empty = self._empty_cp_cache.get(hidden.dtype)
        if empty is None:  # no elements, never written: one for every row
            empty = self._empty_cp_cache[hidden.dtype] = empty_frame_cache(self.cp_config, hidden.dtype)
        out["cp_cache"].append(empty)
        out["cp_sum"].append(embedded)
