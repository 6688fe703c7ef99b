"""Prepacked linears (panel kernel, oneDNN) (mstar.layers.prepack) against the plain matrix-multiply path."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.cpu_ops import ops
from mstar.layers.norms import RMSNorm
from mstar.layers.prepack import (
    PrepackableLinear,
    PrepackedLinear,
    onednn_available,
    prepack_available,
    prepack_linears,
    prepack_mode,
    unchanged,
    versions,
)
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.loader import build_llama_model
from mstar.models.llama.model import LlamaTiny
from mstar.runtime import Runtime
from tests.test_llama import PagedBatcher, tokens

pytestmark = pytest.mark.skipif(not prepack_available(), reason="neither the panel kernel nor oneDNN here")
ROUTES = [m for m, ok in (("panel", ops() is not None), ("onednn", onednn_available())) if ok]

CONFIG = LlamaConfig.from_hf_dict({
    "vocab_size": 4000, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512,
    "tie_word_embeddings": False}, source="test")
PROMPTS = {0: list(range(3, 40)), 1: [7, 9, 11], 2: list(range(100, 164))}


def _logits(module):
    kv = PagedBatcher(module, num_blocks=128)
    prefill = kv.step(module, PROMPTS)
    decode = kv.step(module, {i: [5 + i] for i in PROMPTS})  # one decode row each
    return prefill, decode


def test_prepacked_logits_match_the_plain_path():
    plain = build_llama_model(CONFIG, load_format="dummy", prepack=False)
    packed = build_llama_model(CONFIG, load_format="dummy", prepack=True)
    assert plain.prepacked is None and packed.prepacked is not None
    assert all(layer.self_attn.prepacked and layer.mlp.prepacked for layer in packed.model.layers)
    for a, b in zip(_logits(plain), _logits(packed)):
        assert (a - b).abs().max().item() < 1e-4


def test_changed_weights_fall_back_to_the_plain_path():
    module = build_llama_model(CONFIG, load_format="dummy", prepack=True)
    reference = build_llama_model(CONFIG, load_format="dummy", prepack=False)
    with torch.no_grad():  # in-place edits of every kind of packed weight (shared version counters)
        for m in (module, reference):
            for i, layer in enumerate(m.model.layers):
                (layer.self_attn.q_proj if i % 2 else layer.self_attn.o_proj).weight.mul_(1.5)
                (layer.mlp.up_proj if i % 2 else layer.mlp.down_proj).weight.mul_(0.5)
            m.lm_head.weight.add_(0.01)
    assert module.model.layers[0].self_attn._prepacked(module.model.layers[0].self_attn._qkv) is None
    for sub in reference.modules():  # the norms take no packed weight: compiled in both
        if isinstance(sub, RMSNorm):
            sub.prepack()
    for a, b in zip(_logits(reference), _logits(module)):
        assert torch.equal(a, b)  # every changed projection runs the plain path again


@pytest.mark.parametrize("route", ROUTES)
def test_weights_given_new_storage_are_seen(route):
    """``param.data = w`` keeps the version counter: the storage tells the packed copy is stale."""
    torch.manual_seed(0)
    lin = PrepackableLinear(64, 48)
    lin.prepacked = PrepackedLinear(lin.weight, mode=route)
    x = torch.randn(5, 64)
    assert lin.prepacked.fresh(lin.weight) and unchanged(versions(lin.weight), lin.weight)
    snapshot, version = versions(lin.weight), lin.weight._version
    lin.weight.data = torch.randn(48, 64)
    assert lin.weight._version == version  # what the version alone would miss
    assert not lin.prepacked.fresh(lin.weight) and not unchanged(snapshot, lin.weight)
    with torch.no_grad():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_on_by_default_off_by_env_and_linear_values(monkeypatch):
    monkeypatch.delenv("MSTAR_PREPACK", raising=False)
    module = build_llama_model(CONFIG, load_format="dummy")
    assert module.prepacked is not None and module.prepacked.mode == prepack_mode()
    monkeypatch.setenv("MSTAR_PREPACK", "0")
    assert build_llama_model(CONFIG, load_format="dummy").prepacked is None
    assert build_llama_model(CONFIG, load_format="dummy", prepack=True).prepacked is not None
    monkeypatch.setenv("MSTAR_PREPACK", "onednn")
    assert build_llama_model(CONFIG, load_format="dummy").prepacked.mode == "onednn"
    # every attention, MLP and norm block, and the head
    assert prepack_linears(module) == 1 + 4 * CONFIG.num_hidden_layers + 1
    w = torch.randn(48, 32)
    x = torch.randn(5, 32)
    for mode in ROUTES:
        torch.testing.assert_close(PrepackedLinear(w, mode=mode)(x), x @ w.T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(PrepackedLinear(w.T.contiguous(), in_out=True, mode=mode)(x), x @ w.T,
                                   atol=1e-5, rtol=1e-5)


def test_greedy_tokens_same_with_and_without_prepacking():
    prompts = [torch.tensor([1, *range(10 + i, 14 + 3 * i)]) for i in range(4)]
    outs = []
    for prepack in (False, True):
        with Runtime(LlamaTiny(prepack=prepack)) as rt:
            outs.append([tokens(o) for o in rt.generate([{"input_ids": p} for p in prompts],
                                                         {"max_tokens": 12})])
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0])


def test_bfloat16_model_stays_within_bf16_tolerance_of_float32():
    """``dtype=bfloat16``: weights, activations and KV cache in bf16 (the prepacked weights in bf16
    too); logits agree with the float32 model's to bf16 precision."""
    f32 = build_llama_model(CONFIG, load_format="dummy")
    bf16 = build_llama_model(CONFIG, load_format="dummy", dtype="bfloat16")
    assert bf16.kv_spec.dtype == torch.bfloat16
    if bf16.prepacked is not None and bf16.prepacked.mode == "panel":
        assert bf16.model.layers[0].mlp.prepacked[0].packed.dtype == torch.bfloat16
    for a, b in zip(_logits(f32), _logits(bf16)):
        assert (a - b.float()).abs().max().item() < 0.05 * a.abs().max().item()


def test_serve_dtype_option_reaches_the_model():
    from mstar.cli.main import build_parser
    from mstar.cli.serve_cmd import model_kwargs
    from mstar.model import resolve_model

    args = build_parser().parse_args(["serve", "llama-tiny", "--dtype", "bfloat16"])
    target = type(resolve_model("llama-tiny"))
    kwargs = model_kwargs(target, args)
    assert kwargs == {"dtype": "bfloat16"}
    assert resolve_model("llama-tiny", **kwargs).dtype == torch.bfloat16
    assert model_kwargs(target, build_parser().parse_args(["serve", "llama-tiny"])) == {}


def _lean_off(monkeypatch):
    from mstar.layers.llama import LlamaBackbone
    monkeypatch.setattr(LlamaBackbone, "_lean_layers", lambda *a: None)


@pytest.mark.skipif(ops() is None, reason="the compiled kernels are not built here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_layer_loop_gives_the_modules_bits(monkeypatch, dtype):
    """The backbone's lean loop (the layers' kernels called directly) computes exactly what the
    modules' forwards compute: prefill, then decode rows (the fused attention step planned once)."""
    module = build_llama_model(CONFIG, load_format="dummy", prepack=True, dtype=dtype)
    h = torch.zeros(2, CONFIG.hidden_size, dtype=module.dtype)
    cos, sin = module.model.rotary_emb(torch.tensor([0, 1]), dtype=h.dtype)
    assert module.model._lean_layers(h, cos, sin) is not None  # the lean loop runs below
    lean = _logits(module)
    with monkeypatch.context() as mp:
        _lean_off(mp)
        modules = _logits(module)
    for a, b in zip(lean, modules):
        assert torch.equal(a, b)


@pytest.mark.skipif(ops() is None, reason="the compiled kernels are not built here")
def test_lean_layer_loop_steps_aside_for_hooks_and_changed_weights():
    module = build_llama_model(CONFIG, load_format="dummy", prepack=True)
    backbone = module.model
    h = torch.zeros(2, CONFIG.hidden_size)
    cos, sin = backbone.rotary_emb(torch.tensor([0, 1]))
    assert backbone._lean_layers(h, cos, sin) is not None
    seen = []
    handle = backbone.layers[1].mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    assert backbone._lean_layers(h, cos, sin) is None  # a hook must run: the modules' forwards
    _logits(module)
    assert len(seen) == 2  # prefill and decode went through the hooked module
    handle.remove()
    assert backbone._lean_layers(h, cos, sin) is not None
    with torch.no_grad():
        backbone.layers[2].mlp.down_proj.weight.mul_(0.5)  # the prepacked copy is stale now
    assert backbone._lean_layers(h, cos, sin) is None
    assert backbone._lean_layers(h.to(torch.bfloat16), cos.to(torch.bfloat16), sin.to(torch.bfloat16)) is None


@pytest.mark.skipif(ops() is None, reason="the compiled kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_fused_into_the_panel_store_is_the_add_after_it(dtype):
    """A ``PrepackableLinear``'s bias rides in the kernel's store: the product as stored (bf16:
    rounded) plus the bias, rounded once more: exactly ``y.add_(bias)`` after the plain store; with a
    residual too, exactly ``y.add_(bias) + residual``."""
    from mstar.layers.prepack import PrepackableLinear

    torch.manual_seed(5)
    for n_in, n_out in [(256, 768), (100, 70), (64, 130)]:
        lin = PrepackableLinear(n_in, n_out).to(dtype)
        assert lin.prepack()
        x = torch.randn(2, 17, n_in).to(dtype)
        with torch.inference_mode():
            ref = lin.prepacked(x).add_(lin.bias)
            assert torch.equal(lin(x), ref)
            assert torch.equal(lin.prepacked(x, bias=lin.bias), ref)
            residual = torch.randn(2, 17, n_out).to(dtype)
            both = lin.prepacked(x, residual, bias=lin.bias)  # the bias first, then the residual
            assert torch.equal(both, ref + residual)
            rows = x.reshape(-1, n_in)
            with pytest.raises(RuntimeError, match="does not combine"):
                ops().linear(rows, lin.prepacked.packed, n_out // 2, True, None, lin.bias.detach()[:n_out // 2])


@pytest.mark.skipif(ops() is None, reason="the compiled kernels are not built here")
def test_argmax_without_the_logits_equals_the_argmax_of_them():
    """``PrepackableLinear.argmax``: the index of each row's maximum of ``lin(x)`` (any leading
    shape), a row's the same alone and in a batch; None where the product would have to be stored
    (a bias, a bfloat16 input, hooks, no packed weight): the caller takes the logits then."""
    from mstar.layers.prepack import PrepackableLinear

    torch.manual_seed(7)
    lin = PrepackableLinear(128, 5000, bias=False)
    assert lin.argmax(torch.randn(2, 128)) is None  # not packed yet
    assert lin.prepack()
    x = torch.randn(3, 6, 128)
    with torch.inference_mode():
        got = lin.argmax(x)
        assert got.shape == (3, 6) and torch.equal(got, torch.argmax(lin(x), -1))
        assert torch.equal(lin.argmax(x[1, 2:3]), got[1, 2:3])
        assert lin.argmax(x.bfloat16()) is None
        handle = lin.register_forward_hook(lambda *_: None)
        assert lin.argmax(x) is None
        handle.remove()
    biased = PrepackableLinear(128, 64)
    assert biased.prepack() and biased.argmax(x) is None


@pytest.mark.skipif(ops() is None, reason="the compiled kernels are not built here")
def test_gelu_in_the_panel_store_is_close_to_torch_and_row_invariant():
    """``PrepackableLinear.forward_gelu``: the GELU (erf form) computed in the kernel's store is
    within float32 rounding of ``F.gelu`` of the plain product, over large negative and positive
    inputs too, widths that are not a whole number of panels and without a bias; a row's result is
    the same bits alone and in a batch; a bfloat16 input takes the plain path."""
    import torch.nn.functional as F

    from mstar.layers.prepack import PrepackableLinear

    torch.manual_seed(6)
    for n_in, n_out, bias in [(256, 1024, True), (100, 70, True), (64, 130, False)]:
        lin = PrepackableLinear(n_in, n_out, bias=bias)
        assert lin.prepack()
        x = torch.randn(33, n_in) * 3.0  # pre-activations from about -60 to 60
        with torch.inference_mode():
            ref = F.gelu(F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()))
            got = lin.forward_gelu(x)
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-6)
            assert (got - F.gelu(lin(x))).abs().max() < 2e-6  # the same product, PyTorch's GELU
            for r in (0, 5, 32):
                assert torch.equal(lin.forward_gelu(x[r:r + 1]), got[r:r + 1])
            assert torch.equal(lin.to(torch.bfloat16).forward_gelu(x.bfloat16()),
                               F.gelu(lin(x.bfloat16())))
    with pytest.raises(RuntimeError, match="gelu needs"):
        ops().linear(torch.randn(2, 64), lin.to(torch.float32).prepacked.packed, 130, False,
                     torch.randn(2, 130), None, True)
