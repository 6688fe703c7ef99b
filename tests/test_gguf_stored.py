"""GGUF weights kept as stored (``weights_as_stored``): a tiny Llama written as llama.cpp lays it out
with Q8_0 / Q4_0 / Q4_1 projections, embedding and head, loaded without dequantizing them.

Checked: the module keeps the file's bytes (no float projection weights); its logits equal the same
model computed by the PyTorch path over the file's own blocks (which never sees the packed layout, so
packing, row orders and fusions are checked), and stay near the dequantized float32 model's (the
input quantization's error); greedy tokens are batch invariant through the Runtime; bad requests
fail clearly; the real SmolLM2 file still answers "Paris" in under 1.2x its size."""

from __future__ import annotations

import pytest
import torch

import mstar.layers.quant as quant
from mstar import Runtime
from mstar.layers.prepack import held_weight_bytes
from mstar.layers.quant import QuantizedEmbedding
from mstar.model import resolve_model
from mstar.model.checkpoint import CheckpointError, CheckpointNotFoundError
from mstar.model.gguf_file import GGUFFile
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.loader import build_llama_model
from tests import test_gguf
from tests.helpers import kv_blocks_in_use
from tests.test_llama import PagedBatcher

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

STORED_TYPES = [  # q/k/v share a type, as gate/up do (each group is one multiply)
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
     "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_0,
     "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1},
]
PROMPTS = test_gguf.PROMPTS


def _write(path, *, tied: bool, types=STORED_TYPES) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_gguf, "LAYER_TYPES", types)
        test_gguf.write_gguf(test_gguf._hf_model(tied, seed=5), path)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("stored") / "tiny.gguf"
    _write(path, tied=request.param)
    return path


def _logits(module, prompts=PROMPTS) -> torch.Tensor:
    return PagedBatcher(module).step(module, dict(enumerate(prompts)))


def test_weights_stay_as_stored(tiny):
    config = LlamaConfig.from_pretrained(tiny)
    module = build_llama_model(config, model_path=tiny, weights_as_stored=True)
    gf = GGUFFile(tiny)
    quantized = sum(gf.nbytes(n) for n in gf.tensor_names if gf.type_name(n) != "F32")
    floats = sum(gf.nbytes(n) for n in gf.tensor_names if gf.type_name(n) == "F32")
    # the file's blocks (panels padded to 64 output columns) and the float norms; nothing dequantized
    assert quantized + floats <= held_weight_bytes(module) <= 1.2 * (quantized + floats)
    assert all(p.numel() == 0 for n, p in module.named_parameters() if "norm" not in n)
    assert isinstance(module.model.embed_tokens, QuantizedEmbedding)
    assert module.model.layers[0].self_attn.fresh_prepacked()[0].kind == "Q4_0"
    assert module.model.layers[1].mlp.fresh_prepacked()[1].kind == "Q4_1"
    assert (module.prepacked is module.model.embed_tokens.table) == config.tie_word_embeddings


def test_logits_equal_the_pytorch_path_and_stay_near_the_dequantized_model(tiny, monkeypatch):
    config = LlamaConfig.from_pretrained(tiny)
    stored = _logits(build_llama_model(config, model_path=tiny, weights_as_stored=True))
    dequantized = _logits(build_llama_model(config, model_path=tiny))
    with monkeypatch.context() as mp:  # the PyTorch path, over the file's blocks as read
        mp.setattr(quant, "ops", lambda: None)
        reference = _logits(build_llama_model(config, model_path=tiny, weights_as_stored=True))
    scale = dequantized.abs().max().item()
    torch.testing.assert_close(stored, reference, rtol=1e-4, atol=1e-4 * scale)
    err = (stored - dequantized).abs().max().item()
    # int8 inputs (llama.cpp's scheme) move the logits: 4-7% of their scale on this random model, whose
    # weights are large enough that every layer amplifies what it is given
    assert 0 < err < 0.1 * scale, (err, scale)
    agree = (stored.argmax(-1) == dequantized.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_greedy_tokens_are_batch_invariant_through_the_runtime(tiny):
    model = resolve_model("llama", model_path=str(tiny), weights_as_stored=True)
    params = {"max_tokens": 16, "sampling": {"ignore_eos": True}}
    with Runtime(model) as rt:
        batched = [[int(t) for t in o.tensors("token")]
                   for o in rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], params)]
        alone = [[int(t) for t in rt.generate([{"input_ids": torch.tensor(p)}], params)[0].tensors("token")]
                 for p in PROMPTS]
        assert batched == alone and all(len(t) == 16 for t in batched)
        assert kv_blocks_in_use(rt) == 0


def test_files_that_cannot_be_kept_as_stored_say_why(tmp_path):
    path = tmp_path / "f16.gguf"
    types = [dict(t, attn_output=Q.F16) for t in STORED_TYPES]
    _write(path, tied=True, types=types)
    config = LlamaConfig.from_pretrained(path)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_output\.weight is F16"):
        build_llama_model(config, model_path=path, weights_as_stored=True)
    mixed = tmp_path / "mixed.gguf"
    _write(mixed, tied=True, types=[dict(t, attn_k=Q.Q8_0) for t in STORED_TYPES])
    with pytest.raises(CheckpointError, match="have different types"):
        build_llama_model(LlamaConfig.from_pretrained(mixed), model_path=mixed, weights_as_stored=True)
    with pytest.raises(CheckpointError, match="need a GGUF checkpoint"):
        build_llama_model(config, load_format="dummy", weights_as_stored=True)
    assert build_llama_model(config, model_path=path).model.layers[0].self_attn.stored is False  # default: dequantized


def test_tensor_parallelism_refuses_stored_weights(tiny):
    from mstar.layers.tensor_parallel import TPGroup, apply_tp

    module = build_llama_model(LlamaConfig.from_pretrained(tiny), model_path=tiny, weights_as_stored=True)
    with pytest.raises(ValueError, match="no-weights-as-stored"):
        apply_tp(module, TPGroup(rank=0, size=2, group=None))


def test_smollm2_answers_paris_as_stored():
    from mstar.models.llama.smollm2 import SmolLM2, packaged_gguf
    from tests.test_smollm2 import CHATS, _chat_ids

    try:
        path = packaged_gguf()
    except CheckpointNotFoundError as e:
        pytest.skip(f"the SmolLM2 file is not installed: {e}")
    model = SmolLM2(weights_as_stored=True)
    with Runtime(model) as rt:
        out = rt.generate([{"input_ids": torch.tensor(_chat_ids(model, CHATS[0]))}], {})[0]
        answer = model.tokenizer.decode([int(t) for t in out.tensors("token")])
        assert "Paris" in answer
    module = model.build_submodules(["LLM"])["LLM"]
    assert held_weight_bytes(module) <= 1.2 * path.stat().st_size


def test_serve_flag_reaches_the_model_and_is_refused_elsewhere():
    import argparse

    from mstar.cli.serve_cmd import model_kwargs
    from mstar.model.registry import import_target, registered_models
    from mstar.models.llama.smollm2 import SmolLM2

    args = argparse.Namespace(model="smollm2-135m", model_path=None, load_format=None, dtype=None,
                              weights_as_stored=True)
    assert model_kwargs(SmolLM2, args) == {"weights_as_stored": True}
    bagel = import_target(registered_models()["bagel-tiny"])
    with pytest.raises(ValueError, match="does not take --weights-as-stored"):
        model_kwargs(bagel, argparse.Namespace(model="bagel-tiny", model_path=None, load_format=None, dtype=None,
                                               weights_as_stored=True))
    args.weights_as_stored = None  # the flag not given: nothing passed
    assert model_kwargs(SmolLM2, args) == {}


def test_worker_processes_report_the_weights_they_hold(tiny, caplog):
    import logging

    expected = held_weight_bytes(build_llama_model(LlamaConfig.from_pretrained(tiny), model_path=tiny, weights_as_stored=True))
    model = resolve_model("llama", model_path=str(tiny), weights_as_stored=True)
    with caplog.at_level(logging.INFO, logger="mstar.runtime"), Runtime(model, workers="process"):
        pass
    said = [r.getMessage() for r in caplog.records if "weights in memory" in r.getMessage()]
    assert said == [f"worker rank 0 ready: weights in memory {expected / 2**20:.1f} MiB"]
