"""Qwen3-Omni served as the walks of ``graph.py`` with the nodes of ``nodes.py`` and ``codec_nodes.py``.

``Qwen3Omni`` (``qwen3-omni --model-path DIR``): a checkpoint directory in the hub layout
(``loader.py``); ``Qwen3OmniTiny`` (``qwen3-omni-tiny``): the tiny configuration of ``config.py`` with
seeded random weights, offline.

A ``VadRequest`` (inputs ``vad_audio``, ``vad_state``, ``vad_context``: ``mstar.layers.vad``) walks only
the VAD node: the realtime route's voice activity detection, placed like any node.

Request inputs: ``input_ids`` (one 1-D int tensor: the chat prompt, ending in
``<|im_start|>assistant\\n`` for audio output) and optionally ``audio_features`` (one ``[128, T]`` log-mel
tensor per clip, ``encoders.audio_input``; the prompt holds one audio placeholder per audio-tower
output row). Parameters:

* ``audio`` (bool, default false): also speak the answer (Talker + Code2Wav); text-only requests
  never run them;
* ``voice``: a speaker of the checkpoint (``chelsie``, ``ethan``, ``aiden``; default ``ethan``);
* ``sampling`` / ``max_tokens``: the thinker's ``SamplingParams`` (default greedy, 256 tokens; a
  repetition penalty counts the prompt and the generated tokens, as transformers does);
* ``talker_sampling``: default temperature 0.9, top-k 50, repetition penalty 1.05 (over the
  generated layer-0 codes), ``max_tokens`` 4096 talker steps (the last step's code is never spoken,
  as in the reference: at most ``max_tokens - 1`` frames); ``ignore_eos`` also suppresses codec EOS;
* ``keep_states`` (bool, text answers): keep the Thinker's states at the prompt's audio clips, as a
  spoken answer does, so that a spoken answer to a prompt starting the same takes those clips from
  the prefix cache (the realtime route prefills a turn while it is spoken this way);
* ``code_predictor_sampling``: default temperature 1, top-k 50, top-p 0.8; greedy when the talker
  is greedy and none is given (the reference's rule).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.graph import FinishReason, WalkGraph
from mstar.layers.sampling import SamplingParams, request_sampling
from mstar.layers.vad import VAD_INPUTS, VAD_NODE, SileroVadNode, VadRequest, check_vad_inputs
from mstar.model import ModelDef, NodeSubmodule, WalkState
from mstar.model.checkpoint import check_load_format, reject_checkpoint, resolve_dtype
from mstar.model.decode import prefill_finish, stop_token_set
from mstar.model.tokenizer import LazyTokenizer
from mstar.models.qwen3_omni import graph as omni_graph
from mstar.models.qwen3_omni.config import TINY_HF_CONFIG, Qwen3OmniConfig
from mstar.models.qwen3_omni.media import MediaSettings
from mstar.models.qwen3_omni.request import OmniRequest

__all__ = ["Qwen3Omni", "Qwen3OmniTiny"]

_NODES = ("audio_encoder", "vision_encoder", "Thinker", "Talker", "code_predictor", "frame_assembler", "Code2Wav",
          VAD_NODE)


class Qwen3Omni(LazyTokenizer, ModelDef):
    """A Qwen3-Omni checkpoint directory (``model_path``; its config is read on first use, so the graph
    alone needs none), or ``config`` with ``load_format="dummy"`` for seeded random weights."""

    checks_params = True  # parse_request looks up every params key (Runtime.submit refuses others)
    request_type = (OmniRequest, VadRequest)

    name = "qwen3-omni"
    family = "qwen3-omni"

    def __init__(self, model_path: str | Path | None = None, load_format: str = "auto", dtype: str = "float32",
                 config: Qwen3OmniConfig | Mapping[str, Any] | None = None, seed: int = 0) -> None:
        self.model_path = str(model_path) if model_path is not None else None
        self.load_format = check_load_format(load_format, ("auto", "safetensors", "dummy"))
        self.dtype, self.seed = resolve_dtype(dtype), seed
        if isinstance(config, Mapping):
            config = Qwen3OmniConfig.from_hf_dict(config)
        self._config: Qwen3OmniConfig | None = config  # else read from the checkpoint on first use
        self._media: MediaSettings | None = None  # read with it
        if load_format != "dummy" and self.model_path is None and config is not None:
            raise ValueError("qwen3-omni: a model path is needed to load weights (or load_format='dummy')")

    @property
    def config(self) -> Qwen3OmniConfig:
        if self._config is None:
            if self.model_path is None:
                raise ValueError("qwen3-omni needs --model-path (a checkpoint directory); or serve qwen3-omni-tiny")
            self._config = Qwen3OmniConfig.from_pretrained(self.model_path)
        return self._config

    @property
    def media(self) -> MediaSettings:
        """The checkpoint's image and audio preprocessing (``media.py``: its ``preprocessor_config.json``,
        the defaults without one), checked against the towers' config."""
        if self._media is None:
            from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
                Qwen3OmniMoeAudioEncoderConfig,
                Qwen3OmniMoeVisionEncoderConfig,
            )

            media = MediaSettings.from_checkpoint(self.model_path)
            th = self.config.hf.get("thinker_config") or {}
            # the towers' sizes as transformers builds them (its defaults for keys config.json lacks)
            vision = Qwen3OmniMoeVisionEncoderConfig(**(th.get("vision_config") or {}))
            audio = Qwen3OmniMoeAudioEncoderConfig(**(th.get("audio_config") or {}))
            media.check_against(vision.to_dict(), audio.to_dict())
            self._media = media
        return self._media

    def preflight(self) -> None:
        """The checkpoint's config.json and preprocessor_config.json parse and fit (before any worker
        starts)."""
        self.media  # noqa: B018 - read for its checks

    def _load_tokenizer(self) -> Any:
        from mstar.models.llama.tokenizer import ByteTokenizer, load_tokenizer

        return load_tokenizer(self.model_path, (self.config.tokens.im_end,)) if self.model_path else ByteTokenizer()

    # -- graph -------------------------------------------------------------------------------------
    def build_graph(self) -> WalkGraph:
        """Loop bounds from the config's context lengths; the graph alone (``mstar graph qwen3-omni``)
        needs no checkpoint."""
        if self._config is None and self.model_path is None:
            return omni_graph.build_graph()
        c2w = self.config.code2wav
        exact = omni_graph.code2wav_exact_context(int(c2w.get("num_hidden_layers", 8)),
                                                  int(c2w.get("sliding_window", 72)))
        return omni_graph.build_graph(self.config.thinker.max_position_embeddings,
                                      self.config.talker.text.max_position_embeddings, exact,
                                      num_code_groups=self.config.talker.num_code_groups)

    def next_walk(self, state: WalkState) -> str | None:
        return omni_graph.next_walk(state)

    def finish_reason(self, state: WalkState) -> FinishReason | None:
        """The Thinker's (the answer's text): the prefill's stop flag or the decode loop's."""
        if state.partition != "Thinker":
            return None
        if state.last_walk is not None and state.last_walk.startswith("thinker_prefill"):
            return prefill_finish(state)
        return state.finish

    # -- requests ----------------------------------------------------------------------------------
    def parse_request(self, inputs: Mapping[str, list[Any]], params: Mapping[str, Any]) -> OmniRequest | VadRequest:
        from mstar.models.qwen3_omni import nodes

        if "vad_audio" in inputs:  # voice activity detection over a stretch of audio (``mstar.layers.vad``)
            if set(inputs) != set(VAD_INPUTS) or any(len(inputs[k]) != 1 for k in VAD_INPUTS):
                raise ValueError(f"qwen3-omni: a VAD request has exactly the inputs {list(VAD_INPUTS)}, one each")
            check_vad_inputs(*(inputs[name][0] for name in VAD_INPUTS))
            return VadRequest()
        if "input_ids" not in inputs or len(inputs["input_ids"]) != 1:
            raise ValueError("qwen3-omni: 'input_ids' (one 1-D tensor of prompt token ids) is required")
        ids = inputs["input_ids"][0]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError("qwen3-omni: input_ids must be a non-empty 1-D integer tensor")
        # the checks below read the ids as one Python list: a few list scans instead of some twelve small
        # tensor operations, each a torch dispatch on the caller's thread for every submit
        tokens: list[int] = ids.tolist()
        vocab = self.config.thinker.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"qwen3-omni: input_ids must be in [0, {vocab})")
        sp = _thinker_sampling(params)
        if len(tokens) + sp.max_tokens > self.config.thinker.max_position_embeddings:
            raise ValueError(f"qwen3-omni: prompt ({len(tokens)} tokens) + max_tokens ({sp.max_tokens}) exceeds "
                             f"the context of {self.config.thinker.max_position_embeddings} tokens")
        self._validate_audio_input(tokens, inputs.get("audio_features") or [])
        self._validate_images(tokens, inputs)
        stop_ids = tuple(sorted(stop_token_set(sp, (self.config.tokens.im_end,))))
        if not params.get("audio", False):
            return OmniRequest(sp, stop_ids, keep_states=bool(params.get("keep_states", False)))
        voice, talker, predictor = self._validate_audio(tokens, params, nodes)
        return OmniRequest(sp, stop_ids, True, voice, talker, predictor)

    def _validate_audio_input(self, tokens: list[int], clips: list[Any]) -> None:
        """Each clip ``[mel bins, T]`` float; the prompt holds one placeholder per audio-tower output row."""
        from mstar.models.qwen3_omni.encoders import audio_token_count

        bins = self.media.audio.feature_size
        expected = 0
        for clip in clips:
            if not isinstance(clip, torch.Tensor) or clip.dim() != 2 or clip.shape[0] != bins \
                    or not clip.is_floating_point() or clip.shape[1] < 1:
                raise ValueError(f"qwen3-omni: audio_features must be float [{bins}, frames] tensors")
            expected += audio_token_count(clip.shape[1], self.audio_window)
        placeholders = tokens.count(self.config.tokens.audio)
        if placeholders != expected:
            raise ValueError(f"qwen3-omni: the prompt has {placeholders} audio placeholders, its audio_features "
                             f"need {expected}")

    def _validate_images(self, tokens: list[int], inputs: Mapping[str, list[Any]]) -> None:
        """``pixel_values`` [N, D] and ``image_grid_thw`` [I, 3] together; one placeholder per merged patch."""
        from mstar.models.qwen3_omni.nodes import vision_layout

        has = [name in inputs for name in ("pixel_values", "image_grid_thw")]
        placeholders = tokens.count(self.config.tokens.image)
        if not any(has):
            if placeholders:
                raise ValueError(f"qwen3-omni: the prompt has {placeholders} image placeholders and no images")
            return
        if not all(has):
            raise ValueError("qwen3-omni: pixel_values and image_grid_thw go together")
        pixels, grids = inputs["pixel_values"][0], inputs["image_grid_thw"][0]
        if not isinstance(grids, torch.Tensor) or grids.dim() != 2 or grids.shape[1] != 3 \
                or grids.is_floating_point():
            raise ValueError("qwen3-omni: image_grid_thw must be an integer [images, 3] tensor")
        dim = self.media.image.patch_dim
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 2 or pixels.shape[1] != dim \
                or int(grids.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(f"qwen3-omni: pixel_values must be [patches, {dim}] with one row per grid patch")
        merge = vision_layout(self.config)[0]
        if bool((grids[:, 1:] % merge != 0).any()) or int(grids.min()) < 1:
            raise ValueError(f"qwen3-omni: image grids must be positive with h, w multiples of {merge}")
        expected = int(grids.prod(-1).sum()) // merge ** 2
        if placeholders != expected:
            raise ValueError(f"qwen3-omni: the prompt has {placeholders} image placeholders, its images need "
                             f"{expected}")

    @property
    def audio_window(self) -> int:
        """The audio tower's ``n_window`` (its output length per clip: ``encoders.audio_token_count``)."""
        return int(self.config.hf.get("thinker_config", {}).get("audio_config", {}).get("n_window", 50))

    def _validate_audio(self, tokens: list[int], params: Mapping[str, Any],
                        nodes: Any) -> tuple[str, SamplingParams, SamplingParams]:
        """A speech request's voice, Talker sampling and code predictor sampling, checked."""
        special = nodes.omni_token_ids(self.config)
        voice = str(params.get("voice") or "ethan")
        special.speaker_id(voice)
        if tokens[-3:-1] != [special.im_start, special.assistant]:  # the last '<|im_start|>assistant' pair
            raise ValueError("qwen3-omni: for audio output the prompt must end with '<|im_start|>assistant\\n'")
        talker = nodes.talker_sampling(params)
        predictor = nodes.predictor_sampling(params, talker)
        limit = self.config.talker.text.max_position_embeddings
        if len(tokens) + 9 + talker.max_tokens > limit:
            raise ValueError(f"qwen3-omni: prompt + talker max_tokens ({talker.max_tokens}) exceeds the talker's "
                             f"context of {limit} positions")
        return voice, talker, predictor

    def max_kv_tokens(self, inputs: Mapping[str, list[Any]], request: OmniRequest | VadRequest) -> Mapping[str, int]:
        """Thinker: prompt + max_tokens; Talker (audio only): the user part (<= prompt) + 9 + its steps."""
        if isinstance(request, VadRequest):
            return {}
        n = inputs["input_ids"][0].numel()
        out = {"Thinker": n + request.thinker.max_tokens}
        if request.audio:
            out["Talker"] = n + 9 + request.talker.max_tokens
        return out

    # -- modules -----------------------------------------------------------------------------------
    def build_submodules(self, node_names: Iterable[str]) -> dict[str, NodeSubmodule]:
        from mstar.models.qwen3_omni import codec_nodes, encoder_nodes, loader, nodes, talker_node

        cfg, path, fmt = self.config, self.model_path, self.load_format
        mods: dict[str, NodeSubmodule] = {}
        for node in node_names:
            if node == "Thinker":
                mods[node] = nodes.ThinkerNode(loader.build_thinker(cfg, path, fmt, self.dtype, self.seed), cfg)
            elif node == "Talker":
                lm = loader.build_talker(cfg, path, fmt, self.dtype, self.seed + 1)
                mods[node] = talker_node.TalkerNode(lm, cfg, loader.tts_rows(cfg, path, fmt, self.seed))
            elif node == "code_predictor":
                mods[node] = codec_nodes.CodePredictorNode(loader.build_code_predictor(cfg, path, fmt, self.dtype,
                                                                                 self.seed + 2))
            elif node == "vision_encoder":
                mods[node] = encoder_nodes.VisionEncoderNode(loader.build_vision_tower(cfg, path, fmt, self.seed + 5))
            elif node == "audio_encoder":
                mods[node] = encoder_nodes.AudioEncoderNode(loader.build_audio_tower(cfg, path, fmt, self.seed + 4))
            elif node == "frame_assembler":
                mods[node] = codec_nodes.FrameAssembler()
            elif node == "Code2Wav":
                mods[node] = codec_nodes.Code2WavNode(loader.build_code2wav(cfg, path, fmt, self.seed + 3))
            elif node == VAD_NODE:
                mods[node] = SileroVadNode()
            else:
                raise ValueError(f"qwen3-omni has no node {node!r}; nodes: {', '.join(_NODES)}")
        return mods

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.config.talker.speaker_ids)

    def api_adapter(self):
        from mstar.models.qwen3_omni.adapter import Qwen3OmniAdapter
        from mstar.models.qwen3_omni.nodes import omni_token_ids

        return Qwen3OmniAdapter(self, omni_token_ids(self.config))


def _thinker_defaults() -> Mapping[str, Any]:
    from mstar.models.qwen3_omni.nodes import THINKER_SAMPLING

    return THINKER_SAMPLING


def _thinker_sampling(params: Mapping[str, Any]) -> Any:
    return request_sampling(params, _thinker_defaults())


class Qwen3OmniTiny(Qwen3Omni):
    """The tiny configuration (``config.TINY_HF_CONFIG``: hidden 64, 2 layers, 4 experts, 16 code
    groups over a 64-entry codebook) with seeded random weights and the byte tokenizer: offline."""

    name = "qwen3-omni-tiny"

    def __init__(self, model_path: str | None = None, load_format: str = "dummy", seed: int = 0) -> None:
        reject_checkpoint(self.name, Qwen3Omni.name, model_path, load_format)
        super().__init__(None, "dummy", "float32", Qwen3OmniConfig.from_hf_dict(TINY_HF_CONFIG), seed)
