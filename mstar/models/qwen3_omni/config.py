"""Qwen3-Omni configuration: the fields mstar's thinker and talker read from an HF ``config.json``.

``Qwen3OmniConfig.from_hf_dict`` reads the nested layout transformers writes for
``Qwen3OmniMoeForConditionalGeneration`` (``thinker_config.text_config``, ``talker_config.text_config``,
``talker_config.code_predictor_config``, ``code2wav_config``; special token ids at the top level).
Quirks of the real checkpoint this follows:

* ``head_dim`` is its own field (128 in the real model, not ``hidden_size / num_attention_heads``);
* RoPE sits in ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older
  files), with an interleaved M-RoPE ``mrope_section`` that sums to ``head_dim / 2``;
* the talker's expert count is ``num_experts`` or ``num_local_experts``;
* token ids default to the real Instruct checkpoint's values, not to the transformers class
  defaults (the audio placeholder is 151675 there, the class default 151646 is wrong for it).

``TINY_HF_CONFIG`` is a tiny random-weight configuration that transformers runs end to end
(``qwen3-omni-tiny``): the same dict builds transformers' model and ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.model.validation import check_int
from mstar.models.llama.config import read_json

__all__ = ["NEWLINE_ID", "TINY_HF_CONFIG", "CodePredictorConfig", "MoeTextConfig", "OmniTokenIds", "Qwen3OmniConfig",
           "TalkerConfig"]


def _rope(d: Mapping[str, Any], what: str) -> tuple[float, tuple[int, ...]]:
    """(rope_theta, mrope_section) from either RoPE layout; () when the section is absent (1-D RoPE)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{what}: rope_parameters must be a mapping, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{what}: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    section = tuple(params.get("mrope_section") or ())
    return float(theta), section


def _ints(d: Mapping[str, Any], what: str, *names: str) -> dict[str, int]:
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(f"{what}: missing {', '.join(missing)}")
    return {n: check_int(d[n], f"{what}.{n}") for n in names}


@dataclass(frozen=True)
class MoeTextConfig:
    """A Qwen3 MoE decoder (the thinker's language model, or the talker's)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # dense MLP layers (mlp_only_layers); the talker's ResizeMLP width
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # > 0: a gated shared expert beside the routed ones (talker)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2):
            raise ValueError(f"mrope_section {list(self.mrope_section)} must have 3 parts summing to "
                             f"head_dim / 2 = {self.head_dim // 2}")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the MoE block (else a dense MLP), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], what: str) -> MoeTextConfig:
        theta, section = _rope(d, what)
        experts = d.get("num_experts", d.get("num_local_experts"))
        ints = _ints(d, what, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_experts_per_tok", "moe_intermediate_size")
        heads = ints["num_attention_heads"]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{what}: hidden_act {act!r} is not supported (only 'silu')")
        if d.get("attention_bias"):
            raise ValueError(f"{what}: attention_bias=True is not supported")
        kv_heads = check_int(d.get("num_key_value_heads", heads), f"{what}.num_key_value_heads")
        return cls(**ints, num_key_value_heads=kv_heads,
                   head_dim=check_int(d.get("head_dim") or ints["hidden_size"] // heads, f"{what}.head_dim"),
                   num_experts=check_int(experts, f"{what}.num_experts"),
                   intermediate_size=int(d.get("intermediate_size") or 0),
                   norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                   shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, mrope_section=section,
                   max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                   mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                   decoder_sparse_step=int(d.get("decoder_sparse_step", 1)))


@dataclass(frozen=True)
class CodePredictorConfig:
    """The talker's dense 15-codebook residual predictor (a small Qwen3 with 1-D RoPE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_code_groups: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], what: str) -> CodePredictorConfig:
        theta, _ = _rope(d, what)
        ints = _ints(d, what, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_code_groups")
        heads = ints["num_attention_heads"]
        return cls(**ints, num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                   head_dim=int(d.get("head_dim") or ints["hidden_size"] // heads),
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta)


@dataclass(frozen=True)
class TalkerConfig:
    text: MoeTextConfig
    code_predictor: CodePredictorConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_ids: Mapping[str, int] = field(default_factory=dict)  # lowercase names

    def __post_init__(self) -> None:
        if self.code_predictor.num_code_groups != self.num_code_groups:
            raise ValueError(f"talker num_code_groups ({self.num_code_groups}) != code predictor's "
                             f"({self.code_predictor.num_code_groups})")
        if self.code_predictor.hidden_size != self.text.hidden_size:
            raise ValueError("the code predictor's hidden_size must equal the talker's")

    @property
    def suppressed_from(self) -> int:
        """Codec ids >= this (except ``codec_eos_id``) are never sampled (the reference's rule)."""
        return self.text.vocab_size - 1024

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> TalkerConfig:
        what = "talker_config"
        ints = _ints(d, what, "num_code_groups", "thinker_hidden_size", "accept_hidden_layer", "codec_pad_id",
                     "codec_bos_id", "codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id",
                     "codec_think_eos_id")
        speakers = d.get("speaker_id") or {}
        if not isinstance(speakers, Mapping) or not speakers:
            raise ValueError(f"{what}.speaker_id must be a non-empty mapping of voice name -> codec id")
        ints["codec_eos_id"] = ints.pop("codec_eos_token_id")
        return cls(text=MoeTextConfig.from_hf_dict(d.get("text_config") or {}, f"{what}.text_config"),
                   code_predictor=CodePredictorConfig.from_hf_dict(d.get("code_predictor_config") or {},
                                                                   f"{what}.code_predictor_config"),
                   speaker_ids={str(k).lower(): int(v) for k, v in speakers.items()}, **ints)


NEWLINE_ID = 198  # "\n" in the Qwen tokenizer


@dataclass(frozen=True)
class OmniTokenIds:
    """Token ids of the Thinker's vocabulary and the Talker's codec that the prompts use (defaults:
    the real checkpoint's)."""

    im_start: int = 151644
    im_end: int = 151645
    system: int = 8948
    user: int = 872
    assistant: int = 77091
    newline: int = NEWLINE_ID
    tts_pad: int = 151671
    tts_bos: int = 151672
    tts_eos: int = 151673
    audio: int = 151675
    image: int = 151655
    video: int = 151656
    audio_start: int = 151669
    audio_end: int = 151670
    vision_start: int = 151652
    vision_end: int = 151653
    codec_pad: int = 2148
    codec_bos: int = 2149
    codec_eos: int = 2150
    codec_nothink: int = 2155
    codec_think_bos: int = 2156
    codec_think_eos: int = 2157
    speakers: Mapping[str, int] = field(default_factory=lambda: {"chelsie": 2301, "ethan": 2302, "aiden": 2303})

    def speaker_id(self, voice: str) -> int:
        """The codec id of ``voice`` (case-insensitive); ``ValueError`` naming the choices."""
        key = voice.lower() if isinstance(voice, str) else voice
        if key not in self.speakers:
            raise ValueError(f"unknown voice {voice!r}; choose one of: {', '.join(sorted(self.speakers))}")
        return self.speakers[key]

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> OmniTokenIds:
        """From a ``config.json`` dict (root, thinker and talker ids; absent ones keep the defaults)."""
        th, tk = d.get("thinker_config") or {}, d.get("talker_config") or {}
        pick = {"im_start": d.get("im_start_token_id"), "im_end": d.get("im_end_token_id"),
                "system": d.get("system_token_id"), "user": d.get("user_token_id"),
                "assistant": d.get("assistant_token_id"), "tts_pad": d.get("tts_pad_token_id"),
                "tts_bos": d.get("tts_bos_token_id"), "tts_eos": d.get("tts_eos_token_id"),
                "audio": th.get("audio_token_id"), "image": th.get("image_token_id"),
                "video": th.get("video_token_id"), "audio_start": th.get("audio_start_token_id"),
                "audio_end": th.get("audio_end_token_id"), "vision_start": th.get("vision_start_token_id"),
                "vision_end": th.get("vision_end_token_id"), "codec_pad": tk.get("codec_pad_id"),
                "codec_bos": tk.get("codec_bos_id"), "codec_eos": tk.get("codec_eos_token_id"),
                "codec_nothink": tk.get("codec_nothink_id"), "codec_think_bos": tk.get("codec_think_bos_id"),
                "codec_think_eos": tk.get("codec_think_eos_id")}
        ids = {k: int(v) for k, v in pick.items() if v is not None}
        speakers = tk.get("speaker_id")
        if isinstance(speakers, Mapping) and speakers:
            ids["speakers"] = {str(k).lower(): int(v) for k, v in speakers.items()}
        return cls(**ids)

    @classmethod
    def from_hf(cls, config: object) -> OmniTokenIds:
        """From a transformers ``Qwen3OmniMoeConfig`` (root, thinker and talker ids)."""
        thinker, talker = config.thinker_config, config.talker_config
        return cls(
            im_start=config.im_start_token_id, im_end=config.im_end_token_id,
            system=config.system_token_id, user=config.user_token_id, assistant=config.assistant_token_id,
            tts_pad=config.tts_pad_token_id, tts_bos=config.tts_bos_token_id, tts_eos=config.tts_eos_token_id,
            audio=thinker.audio_token_id, image=thinker.image_token_id, video=thinker.video_token_id,
            audio_start=thinker.audio_start_token_id, audio_end=getattr(thinker, "audio_end_token_id", 151670),
            vision_start=thinker.vision_start_token_id, vision_end=getattr(thinker, "vision_end_token_id", 151653),
            codec_pad=talker.codec_pad_id, codec_bos=talker.codec_bos_id, codec_eos=talker.codec_eos_token_id,
            codec_nothink=talker.codec_nothink_id, codec_think_bos=talker.codec_think_bos_id,
            codec_think_eos=talker.codec_think_eos_id, speakers=dict(talker.speaker_id))


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: MoeTextConfig
    talker: TalkerConfig
    tokens: OmniTokenIds
    hf: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the whole dict, for towers

    def __post_init__(self) -> None:
        check_int(self.talker.accept_hidden_layer, "talker_config.accept_hidden_layer", 0,
                  self.thinker.num_hidden_layers)
        if self.talker.thinker_hidden_size != self.thinker.hidden_size:
            raise ValueError(f"talker thinker_hidden_size ({self.talker.thinker_hidden_size}) != thinker "
                             f"hidden_size ({self.thinker.hidden_size})")

    @property
    def code2wav(self) -> Mapping[str, Any]:
        return self.hf.get("code2wav_config") or {}

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3OmniConfig:
        th = d.get("thinker_config")
        tk = d.get("talker_config")
        if not isinstance(th, Mapping) or not isinstance(tk, Mapping):
            raise ValueError("a Qwen3-Omni config needs thinker_config and talker_config")
        return cls(thinker=MoeTextConfig.from_hf_dict(th.get("text_config") or {}, "thinker_config.text_config"),
                   talker=TalkerConfig.from_hf_dict(tk), tokens=OmniTokenIds.from_hf_dict(d), hf=dict(d))

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> Qwen3OmniConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            from mstar.model.checkpoint import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"{path} not found: a Qwen3-Omni checkpoint directory holds config.json")
        return cls.from_hf_dict(read_json(path, "config.json"))


def _tiny_hf_config() -> dict[str, Any]:
    """The tiny configuration (hidden 64, head_dim 16, codebook 64, 16 code groups) in HF's layout."""
    hidden, head_dim, codebook, groups = 64, 16, 64, 16
    mrope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True,
             "mrope_interleaved": True}
    moe = dict(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=head_dim, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, norm_topk_prob=True, rope_parameters=mrope, max_position_embeddings=4096)
    ids = dict(audio_token_id=151675, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               audio_start_token_id=151669, position_id_per_seconds=13)
    predictor = dict(vocab_size=codebook, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_code_groups=groups,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return {
        "thinker_config": dict(
            text_config=dict(vocab_size=152064, **moe),
            audio_config=dict(encoder_layers=1, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64,
                              downsample_hidden_size=16, output_dim=hidden),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                               deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
            vision_end_token_id=151653, audio_end_token_id=151670, **ids),
        "talker_config": dict(  # room for the default 4096 talker steps after a prompt
            text_config=dict(vocab_size=codebook + 1024, shared_expert_intermediate_size=64,
                             **{**moe, "max_position_embeddings": 8192}),
            code_predictor_config=predictor, num_code_groups=groups, thinker_hidden_size=hidden,
            accept_hidden_layer=1, spatial_merge_size=2, codec_pad_id=codebook + 100, codec_bos_id=codebook + 101,
            codec_eos_token_id=codebook + 102, codec_nothink_id=codebook + 107, codec_think_bos_id=codebook + 108,
            codec_think_eos_id=codebook + 109,
            speaker_id={"chelsie": codebook + 253, "ethan": codebook + 254, "aiden": codebook + 255}, **ids),
        "code2wav_config": dict(
            codebook_size=codebook, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, num_hidden_layers=1, num_quantizers=groups, sliding_window=72,
            upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    }


TINY_HF_CONFIG: Mapping[str, Any] = _tiny_hf_config()
