"""GGUF checkpoints for the llama family, against transformers' own GGUF loader.

A tiny random HF ``LlamaForCausalLM`` is written as a GGUF file with the ``gguf`` package's writer,
the way llama.cpp's converter lays it out (q/k rows permuted, the LM head omitted when tied), with
every supported tensor type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1). mstar's loader and
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` must then hold the same weights, give
the same prefill logits (1e-4) and the same greedy tokens. Bad files fail with errors naming the
tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar import Runtime
from mstar.model import resolve_model
from mstar.model.checkpoint import CheckpointError, CheckpointNotFoundError
from mstar.model.gguf_file import SUPPORTED_TYPES, GGUFFile
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.gguf_loader import gguf_hf_name, unpermute_rows
from mstar.models.llama.loader import build_llama_model
from tests.helpers import kv_blocks_in_use
from tests.test_llama import PagedBatcher

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 16, 2
# per projection, per layer: every supported type appears at least once
LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16, "ffn_gate": Q.Q5_0,
     "ffn_up": Q.Q5_1, "ffn_down": Q.BF16},
    {"attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0, "ffn_gate": Q.BF16,
     "ffn_up": Q.F32, "ffn_down": Q.Q4_1},
]
PROMPTS = [[1, 17, 33, 100, 200, 7, 9, 311], [1, 45], [1, 400, 23, 5, 61, 88, 19, 250, 3, 77, 501, 12]]
GEN = 24


def _hf_model(tied: bool, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=256, tie_word_embeddings=tied, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that every layer matters, norms not all ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(2.0 / p.shape[1] ** 0.5 * torch.randn(p.shape, generator=g))
    return model


def _gguf_name(hf: str) -> str:
    inverse = {gguf_hf_name(n): n for n in ("token_embd.weight", "output_norm.weight", "output.weight")}
    if hf in inverse:
        return inverse[hf]
    for i in range(LAYERS):
        for short in ("attn_norm", "ffn_norm", *LAYER_TYPES[0]):
            if gguf_hf_name(f"blk.{i}.{short}.weight") == hf:
                return f"blk.{i}.{short}.weight"
    raise KeyError(hf)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter row order for q/k: each head's halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype(name: str) -> Q:
    if name.endswith("norm.weight"):
        return Q.F32
    if name in ("token_embd.weight", "output.weight"):
        return Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1
    layer, short = name.split(".")[1:3]
    return LAYER_TYPES[int(layer)][short]


def write_gguf(model, path, *, arch="llama", override=None) -> None:
    """``model`` as llama.cpp lays it out; ``override``: gguf name -> (raw uint8 data, type) to write instead."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf, t in model.state_dict().items():
        name = _gguf_name(hf)
        if name == "output.weight" and c.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        if ".attn_q." in name or ".attn_k." in name:
            data = _permute(data, HEADS if ".attn_q." in name else KV_HEADS)
        qtype = _qtype(name)
        if override and name in override:
            raw, qtype = override[name]
        else:
            raw = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    """(path of the GGUF file, transformers' model loaded from it)."""
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny.gguf"
    write_gguf(_hf_model(request.param, seed=3), path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # exactly GEN tokens, like ignore_eos
    return path, ref


def test_unpermute_undoes_llama_cpp_row_order():
    w = torch.arange(8 * 3 * 5, dtype=torch.float32).reshape(24, 5)
    for heads in (1, 2, 3):
        assert torch.equal(unpermute_rows(torch.from_numpy(_permute(w.numpy(), heads)), heads), w)


def test_config_from_metadata(tiny):
    path, ref = tiny
    cfg = LlamaConfig.from_pretrained(path)
    c = ref.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size) == (
        c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size)
    assert cfg.tie_word_embeddings == c.tie_word_embeddings
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None and cfg.eos_token_ids == (2,)
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9 and cfg.max_position_embeddings == 256
    types = {GGUFFile(path).type_name(n) for n in GGUFFile(path).tensor_names}
    assert types == set(SUPPORTED_TYPES)


def test_weights_and_logits_match_transformers_gguf(tiny):
    path, ref = tiny
    module = build_llama_model(LlamaConfig.from_pretrained(path), model_path=path)
    ours = module.state_dict()
    theirs = ref.state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():  # same dequantized values, q/k rows back in transformers' order
        assert torch.equal(ours[name], t), name
    if ref.config.tie_word_embeddings:
        assert module.lm_head.weight is module.model.embed_tokens.weight
    logits = PagedBatcher(module).step(module, dict(enumerate(PROMPTS)))
    worst = 0.0
    with torch.no_grad():
        for piece, p in zip(torch.split(logits, [len(p) for p in PROMPTS]), PROMPTS):
            worst = max(worst, (piece - ref(torch.tensor([p])).logits[0]).abs().max().item())
    assert worst < 1e-4, worst


def test_greedy_tokens_match_transformers_generate(tiny):
    path, ref = tiny
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    assert all(len(set(e)) > 3 for e in expected), "reference too degenerate to test"
    model = resolve_model("llama", model_path=str(path))  # what `mstar serve llama --model-path x.gguf` builds
    with Runtime(model) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS],
                           {"max_tokens": GEN, "sampling": {"ignore_eos": True}})
        assert [[int(t) for t in o.tensors("token")] for o in outs] == expected
        assert kv_blocks_in_use(rt) == 0


def test_bfloat16_load(tiny):
    path, ref = tiny
    module = build_llama_model(LlamaConfig.from_pretrained(path), model_path=path, dtype="bfloat16")
    assert module.dtype == torch.bfloat16
    w = ref.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(module.state_dict()["model.layers.0.self_attn.q_proj.weight"], w.to(torch.bfloat16))


def _raw(shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Zero bytes for a tensor of ``shape`` (torch order) stored as ``qtype``."""
    return np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)


def test_unsupported_type_and_mismatches_name_the_tensor(tmp_path):
    model = _hf_model(True, seed=5)
    path = tmp_path / "bad.gguf"
    write_gguf(model, path, override={"blk.1.ffn_up.weight": (_raw((128, 64), Q.Q8_1), Q.Q8_1)})
    cfg = LlamaConfig.from_pretrained(path)
    with pytest.raises(CheckpointError, match=r"unsupported tensor type: blk\.1\.ffn_up\.weight has type Q8_1"):
        build_llama_model(cfg, model_path=path)
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up\.weight has type Q8_1"):
        GGUFFile(path).tensor("blk.1.ffn_up.weight")
    # a config that does not fit the file: shapes and missing layers, every tensor named
    wide = LlamaConfig.from_hf_dict({**cfg.to_hf_dict(), "intermediate_size": 256, "num_hidden_layers": 3})
    with pytest.raises(CheckpointError) as err:
        build_llama_model(wide, model_path=path)
    msg = str(err.value)
    assert "missing from the checkpoint: model.layers.2.self_attn.q_proj.weight," in msg
    assert "model.layers.2.post_attention_layernorm.weight; shape mismatch: " in msg
    assert "blk.0.ffn_gate.weight (as model.layers.0.mlp.gate_proj.weight): checkpoint [128, 64] vs model " \
           "[256, 64]" in msg
    other = tmp_path / "other.gguf"
    write_gguf(model, other, arch="gpt2")
    with pytest.raises(CheckpointError, match="general.architecture is 'gpt2'"):
        LlamaConfig.from_pretrained(other)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        LlamaConfig.from_pretrained(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="cannot read GGUF file"):
        LlamaConfig.from_pretrained(tmp_path / "junk.gguf")
