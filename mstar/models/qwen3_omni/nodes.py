"""Qwen3-Omni's nodes (see ``graph.py`` for the walks they serve):

* ``audio_encoder``, ``vision_encoder``: transformers' audio and vision towers over the request's
  clips / images (``encoder_nodes.py``);
* ``Thinker`` (``ThinkerNode``): the MoE thinker over the paged cache (placeholders replaced by the
  towers' embeddings, deepstack features, M-RoPE positions); samples text tokens and, in the
  audio-out walks, streams per fed position ``[n, 2, H]`` = (input embedding, ``accept_hidden_layer``
  output);
* ``Talker`` (``TalkerNode``, ``talker_node.py``): the talker over its own paged cache;
* ``code_predictor``, ``frame_assembler``, ``Code2Wav``: the nodes after the Talker, over codec codes
  and frames (``codec_nodes.py``).

Per-request sampling comes from the request's params (``model.py``): ``sampling`` (thinker),
``talker_sampling``, ``code_predictor_sampling``; ``voice`` picks the speaker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mstar.layers.sampling import SamplingParams, request_sampling, sample
from mstar.model.decode import generation_finish
from mstar.model.submodule import EngineInputs, ForwardInfo, KVSpec, NodeInputs, NodeSubmodule
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.media_cache import LruStore
from mstar.models.qwen3_omni.prompt import OmniTokenIds
from mstar.models.qwen3_omni.thinker import ThinkerLM, mrope_positions

__all__ = ["PREDICTOR_SAMPLING", "TALKER_SAMPLING", "THINKER_SAMPLING", "ThinkerNode",
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
    if talker is None:
        talker = talker_sampling(params)
    if given is None and talker.greedy:
        return SamplingParams(temperature=0.0)
    defaults = {**PREDICTOR_SAMPLING, "seed": None if talker.seed is None else talker.seed + 1}
    return request_sampling({"sampling": given}, defaults)


_FLAGS = (torch.tensor(False), torch.tensor(True))  # shared by every row: flags are read, never written


def flag(value: bool) -> torch.Tensor:
    """A node's bool output (``stop``, ``speak``) as one of two shared tensors."""
    return _FLAGS[bool(value)]


# -- Thinker -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Clip:
    """One audio clip of a prefill's prompt, for the Thinker's states kept per clip (``ThinkerNode.clip_states``)."""

    rows: torch.Tensor  # its placeholder rows in the prompt
    key: bytes  # a digest of the prompt's prefix-cache keys up to its last row: what its states depend on
    kept: torch.Tensor | None  # [rows, H]: the accepted layer's output there, kept from an earlier prompt


@dataclass(frozen=True, slots=True)
class _ThinkerArgs:
    """One request's share of a Thinker forward beyond its token ids (``NodeInputs.args``)."""

    sampling: SamplingParams  # the OmniRequest's Thinker sampling
    stop_ids: tuple[int, ...]
    step: int  # the generated token this forward samples (0: the prefill's)
    stream: bool  # its states go to the Talker (a spoken answer)
    keep: bool  # its states at audio clips are kept (a spoken answer; a text answer with ``keep_states``)
    seen: torch.Tensor | None  # prompt + generated tokens, with a repetition penalty (else None)
    media: list[tuple[torch.Tensor, torch.Tensor]]  # (placeholder rows, tower embeddings) replacing them
    deepstack: tuple[torch.Tensor, torch.Tensor] | None  # (image rows, [layers, n, H]) added after layers
    positions: torch.Tensor | None  # [3, n] M-RoPE position ids of the new tokens (None: a decode token)
    delta: int  # M-RoPE position - cache offset of every token after the prompt (a decode token's position)
    prompt: torch.Tensor | None = None  # a prefill's whole prompt (its leading tokens may come cached)
    clips: tuple[_Clip, ...] = ()  # a prefill's audio clips, with ``keep``


class ThinkerNode(NodeSubmodule):
    """Prefill (``input_ids``; with ``audio_embeds`` / ``image_embeds``, ``deepstack``,
    ``image_grid_thw`` after the towers) and decode (``token``, ``seen``, ``rope_delta``) of the thinker;
    outputs ``token``, ``text`` (the same id, for the client), ``stop``, ``seen`` (prompt + generated
    ids when the request has a repetition penalty, else empty), ``rope_delta`` and ``thinker_states``
    (a list of items per request)."""

    def __init__(self, lm: ThinkerLM, cfg: Qwen3OmniConfig, states_bytes: int = 256 << 20) -> None:
        super().__init__()
        self.lm = lm
        # the accepted layer's output at each audio clip's placeholders, by the prompt up to the clip: a
        # spoken answer's Talker reads it there, and a position that comes from the prefix cache is not
        # computed, so a spoken answer's prompt is reused only through the clips kept here
        self.clip_states = LruStore(states_bytes)
        c = cfg.thinker
        self.kv_spec = KVSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, lm.lm_head.weight.dtype)
        self.accept_layer = cfg.talker.accept_hidden_layer
        self.eos_ids = (cfg.tokens.im_end,)
        self.tokens = cfg.tokens
        self.vision = vision_layout(cfg)

    def prepare_inputs(self, graph_walk: str, fwd_info: ForwardInfo,
                       inputs: Mapping[str, list[torch.Tensor]]) -> NodeInputs:
        req = fwd_info.params  # an OmniRequest (Qwen3Omni.parse_request)
        sp = req.thinker
        penalised = sp.repetition_penalty != 1.0
        stream = not graph_walk.endswith("_text")
        keep = stream or req.keep_states
        if "input_ids" in inputs:
            ids = inputs["input_ids"][0].reshape(-1).to(torch.long)
            media, deepstack, positions, delta = self._prefill_layout(ids, inputs)
            prefix, clips = self._reusable(ids, media, keep)
            args = _ThinkerArgs(sp, req.thinker_stop_ids, 0, stream, keep, ids if penalised else None, media,
                                deepstack, positions, delta, ids, clips)
        else:
            ids = inputs["token"][0].reshape(-1).to(torch.long)
            seen = inputs["seen"][0].reshape(-1).to(torch.long) if penalised else None
            args = _ThinkerArgs(sp, req.thinker_stop_ids, fwd_info.iteration[-1] + 1, stream, keep, seen, [], None,
                                None, int(inputs["rope_delta"][0]))
            prefix = None
        if ids.numel() == 0:
            raise ValueError("the Thinker got no tokens")
        return NodeInputs(tensor_inputs={"ids": ids}, num_tokens=ids.numel(), args=args, prefix_ids=prefix,
                          token_inputs=("ids",))

    def _reusable(self, ids: torch.Tensor, media: list[tuple[torch.Tensor, torch.Tensor]],
                  keep: bool) -> tuple[torch.Tensor, tuple[_Clip, ...]]:
        """The prefix cache's keys of the prompt's leading tokens whose KV a later prompt may reuse
        (a multi-turn voice chat: its earlier turns), and, with ``keep``, its audio clips.

        Up to the first image or video placeholder: an image's KV depends on its grid's positions and
        deepstack features. An audio placeholder's KV depends only on its embedding and its
        (sequential) position, so it is keyed by the embedding (``audio_keys``). With ``keep`` (a
        spoken answer, whose Talker reads the accepted layer's output at every audio placeholder,
        which a cached position does not compute) only up to the first clip whose states are not
        kept in ``clip_states``: the clips from there on are computed, and kept."""
        t = self.tokens
        visual = ((ids == t.image) | (ids == t.video)).nonzero()
        end = int(visual[0]) if visual.numel() else ids.numel()
        audio = next(((rows, values) for rows, values in media if rows.numel() and int(ids[rows[0]]) == t.audio), None)
        if audio is None:
            return ids[:end], ()
        rows, values = audio
        keys = ids[:end].clone()
        inside = rows < end
        keys[rows[inside]] = torch.tensor(audio_keys(values[inside]), dtype=torch.long)
        if not keep:
            return keys, ()
        clips, cut = [], None
        for run in _runs(rows[inside]):
            key = hashlib.blake2b(keys[:int(run[-1]) + 1].numpy().tobytes(), digest_size=16).digest()
            kept = self.clip_states.get(key) if cut is None else None
            if kept is None and cut is None:
                cut = int(run[0])
            clips.append(_Clip(run, key, kept))
        return keys[:cut], tuple(clips)

    def _prefill_layout(self, ids: torch.Tensor, inputs: Mapping[str, list]) -> tuple:
        """A prefill's media (placeholder rows, embeddings), deepstack, M-RoPE positions and delta."""
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
        return media, deepstack, positions, delta

    @staticmethod
    def _cached(ei: EngineInputs) -> list[int]:
        """Per request, the leading prompt tokens whose KV came from the prefix cache (not computed)."""
        return [0 if req.positions is None else req.positions.shape[1] - n
                for req, n in zip(ei.args, ei.num_tokens)]

    @staticmethod
    def _positions(ei: EngineInputs) -> torch.Tensor:
        """The batch's ``[3, tokens]`` M-RoPE position ids: a prefill's from its request, a decode token's
        its cache offset (``ei.positions``) + the request's delta on all three axes."""
        reqs: list[_ThinkerArgs] = ei.args
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
                       outputs: Mapping[str, list[Any]]) -> tuple[dict[str, torch.Tensor], list] | None:
        """A decode step's next batch (what ``prepare_inputs`` makes of the fed-back ``token`` and
        ``rope_delta``): each row's new token, its step one further; not with a repetition penalty
        (its seen tokens grow) or media (a prefill's)."""
        args: list[_ThinkerArgs] = engine_inputs.args
        tokens = outputs.get("token")
        if tokens is None or any(a.seen is not None or a.media or a.deepstack is not None for a in args):
            return None
        ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0].reshape(-1)
        if ids.dtype != torch.long or ids.shape[0] != len(tokens):
            return None
        return {"ids": ids}, [_ThinkerArgs(a.sampling, a.stop_ids, a.step + 1, a.stream, a.keep, None, [], None, None,
                                           a.delta) for a in args]

    def _embed(self, ids: torch.Tensor, ei: EngineInputs) -> torch.Tensor:
        embeds = self.lm.embed(ids)
        for start, skip, req in zip(_starts(ei), self._cached(ei), ei.args):
            for rows, values in req.media:
                if skip:  # placeholders before ``skip`` came cached (audio ones, keyed by ``_reusable``)
                    computed = rows >= skip
                    rows, values = rows[computed], values[computed]
                embeds = embeds.index_copy(0, rows.to(embeds.device) + start - skip, values.to(embeds))
        return embeds

    def _deepstack(self, ei: EngineInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per deepstack layer, (batch rows, features) of every request with images."""
        parts = [(rows + start - skip, feats) for start, skip, req in zip(_starts(ei), self._cached(ei),
                                                                         ei.args)
                 if req.deepstack is not None for rows, feats in [req.deepstack]]
        if not parts:
            return []
        layers = parts[0][1].shape[0]
        return [(torch.cat([r for r, _ in parts]), torch.cat([f[k] for _, f in parts])) for k in range(layers)]

    def forward(self, graph_walk: str | None, engine_inputs: EngineInputs,
                ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        ei = engine_inputs
        args: list[_ThinkerArgs] = ei.args
        captures = any(a.keep for a in args)
        embeds = self._embed(ids, ei)
        positions = self._positions(ei)
        out = self.lm(embeds, ei, capture=self.accept_layer if captures else None, mrope_positions=positions,
                      deepstack=self._deepstack(ei))
        last = out.hidden[ei.last_token_rows().to(out.hidden.device)]
        seen, sampling = [a.seen for a in args], [a.sampling for a in args]
        tokens = None
        if all(sp.greedy and sp.repetition_penalty == 1.0 for sp in sampling):  # ``sample``: the logits' argmax
            tokens = self.lm.lm_head.argmax(last)  # without writing the logits out (None: no such path)
        if tokens is None:
            tokens = sample(self.lm.lm_head(last), sampling, None if all(s is None for s in seen) else seen,
                            [a.step for a in args])
        tokens = tokens.cpu()
        states = torch.stack([embeds, out.captured], dim=1).cpu() if captures else None
        cached = self._cached(ei)
        result: dict[str, list] = {"token": [], "text": [], "stop": [], "thinker_states": [], "rope_delta": [],
                                   "seen": []}
        # per row, views of one tensor for the batch: tokens, M-RoPE offsets
        ids, rows = tokens.tolist(), tokens.view(-1, 1).unbind(0)
        deltas = torch.tensor([a.delta for a in args]).view(-1, 1).unbind(0)
        per_request = self._states(states, ei, cached) if states is not None else None
        if per_request is not None:
            self._keep_clips(per_request, args)
        for i in range(len(ei.num_tokens)):
            tok = rows[i]
            result["token"].append(tok)
            result["text"].append(tok)
            a = args[i]
            result["stop"].append(generation_finish(ids[i], a.step, a.sampling, a.stop_ids))
            result["rope_delta"].append(deltas[i])
            # prompt + generated tokens, for the repetition penalty (empty when the request has none)
            result["seen"].append(torch.zeros(0, dtype=torch.long) if seen[i] is None
                                  else torch.cat([seen[i], tok]))
            result["thinker_states"].append([per_request[i]] if a.stream else [])
        return result

    def _states(self, computed: torch.Tensor, ei: EngineInputs, cached: list[int]) -> list[torch.Tensor]:
        """Each request's ``[rows, 2, H]`` states (views of one tensor): a decode token's row, a
        prefill's whole prompt, whose cached leading positions get their input embeddings (text: the
        embedding table; one lookup for the batch) and, for the accepted layer's output, which was not
        computed, the states kept for their audio clips (``_reusable`` reuses no further) and zeros
        elsewhere: the Talker reads that output only at media placeholders."""
        if not any(cached):
            return list(computed.split(ei.num_tokens))
        reqs: list[_ThinkerArgs] = ei.args
        heads = self.lm.embed(torch.cat([r.prompt[:c] for r, c in zip(reqs, cached) if c])
                              .to(self.lm.lm_head.weight.device)).to(computed)
        out = computed.new_empty(sum(cached) + computed.shape[0], *computed.shape[1:])
        at = head = row = 0  # in out, heads, computed
        for req, c, n in zip(reqs, cached, ei.num_tokens):  # slices, not masks: out is written once
            out[at:at + c, 0] = heads[head:head + c]
            out[at:at + c, 1] = 0
            for clip in req.clips:
                if clip.kept is not None and int(clip.rows[0]) < c:
                    early = clip.rows < c  # a clip the cache holds only part of: the rest was computed
                    out[at + clip.rows[early], 1] = clip.kept[early].to(out)
            out[at + c:at + c + n] = computed[row:row + n]
            at, head, row = at + c + n, head + c, row + n
        return list(out.split([c + n for c, n in zip(cached, ei.num_tokens)]))

    def _keep_clips(self, per_request: list[torch.Tensor], args: list[_ThinkerArgs]) -> None:
        """Keep the accepted layer's output at each prefill's audio clips computed here (not kept yet)."""
        for a, states in zip(args, per_request):
            for clip in a.clips:
                if clip.kept is None:
                    self.clip_states.put(clip.key, states[clip.rows, 1])  # indexing copies: not a view of the batch


def _runs(rows: torch.Tensor) -> list[torch.Tensor]:
    """Sorted placeholder rows split into runs of consecutive rows: one per clip (its audio start and
    end tokens separate one clip from the next)."""
    if rows.numel() == 0:
        return []
    return list(rows.tensor_split(((rows[1:] - rows[:-1]) != 1).nonzero().reshape(-1) + 1))


_AUDIO_KEY_BASE = 1 << 56  # above every vocabulary: a key never equals a token id


def audio_keys(values: torch.Tensor) -> list[int]:
    """A prefix-cache key per audio placeholder row: a digest of its embedding's bytes (the same clip
    gives the same embeddings, so the same keys in any process), above every token id."""
    raw = values.detach().cpu().contiguous()
    raw = raw.view(torch.uint8).reshape(raw.shape[0], -1).numpy()
    return [_AUDIO_KEY_BASE + int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=7).digest(), "little")
            for row in raw]


def _starts(ei: EngineInputs) -> list[int]:
    """Each request's first row in the batch's flat token dimension."""
    return [0, *torch.tensor(ei.num_tokens).cumsum(0).tolist()[:-1]]


def vision_layout(cfg: Qwen3OmniConfig) -> tuple[int, int]:
    """(spatial merge size, position ids per second) of the M-RoPE image positions."""
    th = cfg.hf.get("thinker_config") or {}
    merge = (th.get("vision_config") or {}).get("spatial_merge_size", 2)
    return int(merge), int(th.get("position_id_per_seconds", 13))
