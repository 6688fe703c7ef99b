"""Llama family: parity with transformers' LlamaForCausalLM (fp32, CPU), loading, llama-tiny offline.

Parity is the point: a tiny random HF Llama (GQA 4/2, llama3 RoPE scaling, tied embeddings) is
saved as a sharded safetensors checkpoint, loaded through mstar's loader, and must reproduce HF's
prefill logits (1e-4) and HF ``generate`` greedy tokens, batched with other requests, on one rank
and on a prefill/decode split over two ranks.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import shutil

import pytest
import torch

from mstar import RequestStatus, Runtime
from mstar.graph import FinishReason
from mstar.layers.paged_attention import AttentionMetadata, QueryMode
from mstar.layers.rotary import RopeScaling, RotaryEmbedding, compute_inv_freq
from mstar.model import EngineInputs, resolve_model
from mstar.models.llama.config import TINY, LlamaConfig
from mstar.models.llama.loader import CheckpointError, CheckpointNotFoundError, build_llama_model
from mstar.models.llama.model import LlamaLM, LlamaTiny
from mstar.models.llama.tokenizer import ByteTokenizer, load_tokenizer
from mstar.placement import Placement
from tests.helpers import kv_blocks_in_use

ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = [[1, 17, 33, 100, 200, 7, 9, 311], [1, 45], [1, 400, 23, 5, 61, 88, 19, 250, 3, 77, 501, 12, 9, 64],
           [1, 2, 3, 4, 5]]
GEN = 64
GREEDY = {"max_tokens": GEN, "sampling": {"temperature": 0.0, "ignore_eos": True}}
PD_SPLIT = {"model": "llama", "node_groups": [
    {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
    {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}]}


# -- fixtures: tiny random HF checkpoints --------------------------------------------------------------
def _hf_config(tied: bool):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters=dict(ROPE))


def _hf_model(tied: bool, seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_hf_config(tied)).eval()
    # weights large enough that layers matter (varied greedy text) and norms that are not all ones
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(2.0 / p.shape[1] ** 0.5 * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    return model


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory):
    model = _hf_model(tied=True, seed=0)
    path = tmp_path_factory.mktemp("llama_tied")
    model.save_pretrained(path, max_shard_size="100KB")
    return model, path


@pytest.fixture(scope="module")
def untied_ckpt(tmp_path_factory):
    model = _hf_model(tied=False, seed=1)
    path = tmp_path_factory.mktemp("llama_untied")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def hf_greedy(tied_ckpt):
    """HF generate(do_sample=False) continuations of PROMPTS, one prompt at a time."""
    model, _ = tied_ckpt
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN,
                                 do_sample=False)
            outs.append(out[0, len(p):].tolist())
    assert all(len(o) == GEN for o in outs)
    assert all(len(set(o)) > 5 for o in outs), "reference continuations too degenerate to test parity"
    return outs


def tokens(out):
    assert out.status is RequestStatus.FINISHED, out.error
    return [int(t) for t in out.tensors("token")]



# -- hand-driven batches over a paged cache --------------------------------------------------------
class PagedBatcher:
    """Minimal block bookkeeping to call the LLM module directly with hand-built EngineInputs."""

    def __init__(self, module, num_blocks=64, block_size=4):
        spec = module.kv_spec
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.caches = [(torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype))
                       for _ in range(spec.num_layers)]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, module, seqs: dict[int, list[int]]) -> torch.Tensor:
        """Append ``seqs`` (seq id -> new tokens) in one batch; logits of every new token [T, V]."""
        slots, positions, ctx, tables, qlens = [], [], [], [], []
        for sid, new in seqs.items():
            table, before = self.tables.setdefault(sid, []), self.lens.get(sid, 0)
            for pos in range(before, before + len(new)):
                if pos // self.block_size >= len(table):
                    table.append(self.free.pop(0))
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            self.lens[sid] = before + len(new)
            ctx.append(self.lens[sid])
            tables.append(list(table))
            qlens.append(len(new))
        n = len(seqs)
        meta = AttentionMetadata.build(qlens, tables, ctx, [QueryMode.CAUSAL_APPEND] * n, slots)
        ei = EngineInputs(walks=["prefill"] * n, nodes=["LLM"] * n, request_ids=[str(s) for s in seqs],
                          infos=[], splits={}, args=[None] * n, attention=meta, kv_caches=self.caches,
                          positions=torch.tensor(positions, dtype=torch.long), num_tokens=qlens)
        ids = torch.tensor([t for new in seqs.values() for t in new])
        with torch.inference_mode():
            return module.compute_logits(module.model(ids, ei)).float()


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# -- rotary ------------------------------------------------------------------------------------------
def test_rotary_llama3_inv_freq_and_tables_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for head_dim, rope in [(16, ROPE), (64, {**ROPE, "rope_theta": 500000.0, "factor": 32.0,
                                             "original_max_position_embeddings": 8192})]:
        hf_cfg = _hf_config(tied=True)
        hf_cfg.head_dim = head_dim
        hf_cfg.max_position_embeddings = 16384
        hf_cfg.rope_parameters = dict(rope)
        ref, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
        scaling = RopeScaling("llama3", rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
        ours = compute_inv_freq(head_dim, rope["rope_theta"], scaling)
        assert scale == 1.0 and ours.dtype == torch.float32
        assert torch.equal(ours, ref), (ours - ref).abs().max()
        # every band of the schedule is exercised: kept, blended and scaled frequencies
        plain = compute_inv_freq(head_dim, rope["rope_theta"])
        assert (ours == plain).any() and (ours == plain / rope["factor"]).any()
        assert ((ours != plain) & (ours != plain / rope["factor"])).any()
        # cos/sin tables at arbitrary positions equal HF's rotary module
        pos = torch.tensor([0, 1, 5, 63, 64, 200, 4095])
        cos, sin = RotaryEmbedding(head_dim, rope["rope_theta"], scaling)(pos)
        hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
        assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    # linear scaling and the default schedule too
    cfg = _hf_config(tied=True)
    cfg.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](cfg)
    assert torch.equal(compute_inv_freq(16, 10000.0, RopeScaling("linear", 4.0)), ref)


def test_config_reads_both_rope_layouts(tied_ckpt):
    _, path = tied_ckpt
    cfg = LlamaConfig.from_pretrained(path)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    # legacy layout: top-level rope_theta, rope_scaling with "type", eos list, no head_dim
    legacy = {k: v for k, v in json.loads((path / "config.json").read_text()).items()
              if k not in ("rope_parameters", "head_dim")}
    legacy.update(rope_theta=500000.0, eos_token_id=[2, 7],
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0})
    old = LlamaConfig.from_hf_dict(legacy)
    assert old.rope_theta == 500000.0 and old.eos_token_ids == (2, 7) and old.head_dim == 16
    assert old.rope_scaling.original_max_position_embeddings == 256  # falls back to max_position_embeddings
    assert LlamaConfig.from_hf_dict({**legacy, "rope_scaling": None}).rope_scaling is None
    assert LlamaConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="missing required Llama config field"):
        LlamaConfig.from_hf_dict({"vocab_size": 10})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        LlamaConfig.from_hf_dict({**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


# -- parity ------------------------------------------------------------------------------------------
def test_sharded_checkpoint_prefill_and_decode_logits_match_hf(tied_ckpt, caplog):
    hf, path = tied_ckpt
    shards = len(list(path.glob("*.safetensors")))
    assert (path / "model.safetensors.index.json").is_file() and shards >= 3
    with caplog.at_level(logging.INFO, logger="mstar.models.llama.loader"):
        module = build_llama_model(LlamaConfig.from_pretrained(path), model_path=path)
    assert sum(f"loaded shard {i}/{shards}" in caplog.text for i in range(1, shards + 1)) == shards
    assert module.lm_head.weight is module.model.embed_tokens.weight
    kv = PagedBatcher(module)
    logits = kv.step(module, dict(enumerate(PROMPTS)))  # one batched prefill, ragged lengths
    worst = 0.0
    for piece, p in zip(torch.split(logits, [len(p) for p in PROMPTS]), PROMPTS):
        ref = _hf_logits(hf, p)
        worst = max(worst, (piece - ref).abs().max().item())
    # then one decode step per sequence, attending over the paged cache
    nxt = {i: [int(logits[sum(len(q) for q in PROMPTS[:i + 1]) - 1].argmax())] for i in range(len(PROMPTS))}
    step = kv.step(module, nxt)
    for i, p in enumerate(PROMPTS):
        ref = _hf_logits(hf, p + nxt[i])[-1]
        worst = max(worst, (step[i] - ref).abs().max().item())
    print(f"max |logits - HF| = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("placement", [None, PD_SPLIT], ids=["one-rank", "prefill-decode-split"])
def test_greedy_generation_matches_hf_generate_batched(tied_ckpt, hf_greedy, placement):
    _, path = tied_ckpt
    model = LlamaLM(model_path=path)
    with Runtime(model, Placement.from_dict(placement) if placement else None) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], GREEDY)
        for o, ref in zip(outs, hf_greedy):
            assert tokens(o) == ref
            assert o.finish_reason is FinishReason.LENGTH  # the decode walk's, from the rank it ran on
        ranks = rt.stats()["ranks"]
        assert max(ranks[-1]["batch_sizes"]["LLM"]) > 1  # requests of different lengths decoded together
        if placement:
            assert all(sum(r["batch_sizes"]["LLM"].values()) > 0 for r in ranks)
        assert kv_blocks_in_use(rt) == 0


def test_repetition_penalty_and_stop_tokens_match_hf(tied_ckpt, hf_greedy):
    hf, path = tied_ckpt
    p = PROMPTS[0]
    with torch.no_grad():
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          repetition_penalty=1.5)[0, len(p):].tolist()
    full = hf_greedy[0]
    k = next(i for i, t in enumerate(full) if i >= 3 and t not in full[:i])  # first occurrence of a token
    with Runtime(LlamaLM(model_path=path)) as rt:
        pen, stop, one, first = rt.generate(
            [{"input_ids": torch.tensor(p)}] * 4,
            [{"max_tokens": 24, "sampling": {"repetition_penalty": 1.5, "ignore_eos": True}},
             {"max_tokens": GEN, "sampling": {"stop_token_ids": [full[k]], "ignore_eos": True}},
             {"max_tokens": 1},
             {"max_tokens": GEN, "sampling": {"stop_token_ids": [full[0]], "ignore_eos": True}}])
        assert tokens(pen) == ref != full[:24]
        assert tokens(stop) == full[:k + 1]  # the stop token is emitted, nothing after it
        assert tokens(one) == full[:1]
        assert tokens(first) == full[:1]  # the prefill's token stops it: no decode walk
        # the finish reasons the LLM node's stop flag decided (a decode loop's, or the prefill's)
        assert [o.finish_reason for o in (pen, stop, one, first)] == [
            FinishReason.LENGTH, FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP]
        assert kv_blocks_in_use(rt) == 0


class _OpenAIPenalties:
    """OpenAI's presence / frequency penalties as a transformers logits processor, written here from
    the API reference (counts over the generated tokens only): the reference the sampler is held to."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            for tok, count in collections.Counter(ids[self.prompt_len:].tolist()).items():
                scores[row, tok] -= self.presence + self.frequency * count
        return scores


def test_openai_penalties_bias_and_logprobs_match_hf(tied_ckpt, hf_greedy):
    """presence / frequency penalties and logit_bias give transformers' greedy tokens with the same
    penalties (a logits processor) and bias (``sequence_bias``); logprobs are the log-softmax of its
    processed scores, top 5 included; and a free greedy row batched beside them keeps its tokens."""
    transformers = pytest.importorskip("transformers")
    hf, path = tied_ckpt
    p, n = PROMPTS[0], 24
    bias = {hf_greedy[0][3]: -100.0, 300: 4.0, 17: 2.5}
    with torch.no_grad():
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          sequence_bias={(t,): b for t, b in bias.items()}, output_scores=True,
                          return_dict_in_generate=True,
                          logits_processor=transformers.LogitsProcessorList([_OpenAIPenalties(len(p), 0.7, 0.9)]))
    ref_tokens = ref.sequences[0, len(p):].tolist()
    ref_lp = torch.log_softmax(torch.cat(ref.scores).float(), dim=-1)
    assert ref_tokens != hf_greedy[0][:n]  # the options change the answer
    sampling = {"presence_penalty": 0.7, "frequency_penalty": 0.9, "logit_bias": {str(t): b for t, b in bias.items()},
                "logprobs": 5, "ignore_eos": True}
    with Runtime(LlamaLM(model_path=path)) as rt:
        shaped, free = rt.generate([{"input_ids": torch.tensor(p)}, {"input_ids": torch.tensor(PROMPTS[1])}],
                                   [{"max_tokens": n, "sampling": sampling}, GREEDY])
        assert tokens(shaped) == ref_tokens
        assert tokens(free) == hf_greedy[1] and "logprobs" not in free.outputs
        steps = shaped.outputs["logprobs"]
        assert len(steps) == n
        for i, (ids_i, lps_i) in enumerate(steps):
            assert ids_i.shape == lps_i.shape == (6,) and int(ids_i[0]) == ref_tokens[i]
            want_top = torch.topk(ref_lp[i], 5)
            assert ids_i[1:].tolist() == want_top.indices.tolist()
            torch.testing.assert_close(lps_i, torch.cat([ref_lp[i, ref_tokens[i]].reshape(1), want_top.values]),
                                       atol=1e-4, rtol=0)
        assert kv_blocks_in_use(rt) == 0


def test_extended_sampling_is_refused_where_not_read():
    """A model whose nodes do not read presence / frequency penalties, logit_bias or logprobs refuses
    them by name instead of ignoring them; the bias ids are checked against the vocabulary."""
    from mstar.layers.sampling import request_sampling

    with pytest.raises(ValueError, match="presence_penalty, logprobs: not supported"):
        request_sampling({"sampling": {"presence_penalty": 0.5, "logprobs": 2}}, {})
    assert request_sampling({"sampling": {"logprobs": 2}}, {}, extended=True).logprobs == 2
    model = LlamaTiny()
    with pytest.raises(ValueError, match="logit_bias token ids \\[99999\\]"):
        model.validate_request({"input_ids": [torch.tensor([1, 2])]}, {"sampling": {"logit_bias": {"99999": 1}}})


# -- loading -----------------------------------------------------------------------------------------
def test_untied_checkpoint_loads_with_its_lm_head(untied_ckpt):
    from safetensors import safe_open

    hf, path = untied_ckpt
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    module = build_llama_model(LlamaConfig.from_pretrained(path), model_path=path)
    assert module.lm_head.weight is not module.model.embed_tokens.weight
    torch.testing.assert_close(module.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)
    logits = PagedBatcher(module).step(module, {0: PROMPTS[2]})
    assert (logits - _hf_logits(hf, PROMPTS[2])).abs().max().item() < 1e-4


def test_bfloat16_load(tied_ckpt):
    hf, path = tied_ckpt
    module = build_llama_model(LlamaConfig.from_pretrained(path), model_path=path, dtype="bfloat16")
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert module.kv_spec.dtype == torch.bfloat16
    torch.testing.assert_close(module.model.norm.weight.float(), hf.model.norm.weight.bfloat16().float())
    logits = PagedBatcher(module).step(module, {0: PROMPTS[0]})
    ref = _hf_logits(hf, PROMPTS[0])
    hf_bf16_err = (_hf_logits(copy.deepcopy(hf).to(torch.bfloat16), PROMPTS[0]) - ref).abs().max().item()
    # as close to the fp32 logits as transformers' own bf16 model is
    assert logits.dtype == torch.float32 and (logits - ref).abs().max().item() < 2 * hf_bf16_err
    with Runtime(LlamaLM(model_path=path, dtype="bfloat16")) as rt:
        assert len(tokens(rt.generate({"input_ids": torch.tensor(PROMPTS[1])}, {"max_tokens": 8})[0])) == 8


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_checkpoint_errors_are_clear(untied_ckpt, tmp_path):
    _, path = untied_ckpt
    cfg = LlamaConfig.from_pretrained(path)
    missing = _rewrite(path, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError,
                       match=r"missing from the checkpoint: model\.layers\.1\.mlp\.up_proj\.weight"):
        build_llama_model(cfg, model_path=missing)
    no_head = _rewrite(path, tmp_path / "no_head", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: lm_head\.weight"):
        build_llama_model(cfg, model_path=no_head)

    def extra_and_bad(t):
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        t["model.norm.weight"] = torch.ones(65)

    bad = _rewrite(path, tmp_path / "bad", extra_and_bad)
    with pytest.raises(CheckpointError, match=r"unexpected\): model\.layers\.0\.self_attn\.q_proj\.bias.*"
                       r"shape mismatch: model\.norm\.weight: checkpoint \[65\] vs model \[64\]"):
        build_llama_model(cfg, model_path=bad)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        LlamaLM(model_path=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no config.json"):
        LlamaLM(model_path=tmp_path / "empty")
    shutil.copy(path / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(CheckpointNotFoundError, match="no weights in"):
        LlamaLM(model_path=tmp_path / "empty").build_submodules(["LLM"])
    with pytest.raises(ValueError, match="model_path is required"):
        LlamaLM(config=TINY)
    dummy = LlamaLM(model_path=tmp_path / "empty", load_format="dummy").build_submodules(["LLM"])["LLM"]
    assert dummy.lm_head.weight.shape == (512, 64)
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        LlamaLM(config={**cfg.to_hf_dict(), "attention_bias": True}, load_format="dummy")


# -- llama-tiny, sampling, validation, tokenizers ------------------------------------------------------
def test_llama_tiny_resolves_by_name_and_generates_offline():
    model = resolve_model("llama-tiny")
    assert isinstance(model, LlamaTiny) and model.name == "llama-tiny" and model.config == TINY
    tok = model.tokenizer
    ids = tok.encode("Hello, M*!")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "Hello, M*!"
    with Runtime("llama-tiny") as rt:
        outs = rt.generate([{"input_ids": torch.tensor(ids)}, {"input_ids": torch.tensor(ids[:4])}],
                           {"max_tokens": 12})
        assert [len(tokens(o)) for o in outs] == [12, 12]
        assert isinstance(tok.decode(tokens(outs[0])), str)
        assert kv_blocks_in_use(rt) == 0


def test_seeded_sampling_is_batch_invariant():
    params = {"max_tokens": 16, "sampling": {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234,
                                             "repetition_penalty": 1.2}}
    prompts = [torch.tensor([1, *range(10 + i, 14 + 3 * i)]) for i in range(4)]
    with Runtime(LlamaTiny()) as rt:
        alone = tokens(rt.generate({"input_ids": prompts[2]}, params)[0])
        mixed = rt.generate([{"input_ids": p} for p in prompts], params)
        assert tokens(mixed[2]) == alone and len(set(alone)) > 1
        other_seed = {**params, "sampling": {**params["sampling"], "seed": 99}}
        assert tokens(rt.generate({"input_ids": prompts[2]}, other_seed)[0]) != alone


def test_validate_request_errors():
    m = LlamaTiny()
    ok = torch.tensor([1, 2, 3])
    m.validate_request({"input_ids": [ok]}, {"max_tokens": 5})
    cases = [
        ({}, {}, "'input_ids' is required"),
        ({"input_ids": [[1, 2]]}, {}, "one 1-D integer torch tensor"),
        ({"input_ids": [ok[None]]}, {}, "1-D integer tensor, got shape"),
        ({"input_ids": [ok.float()]}, {}, "1-D integer tensor"),
        ({"input_ids": [torch.tensor([], dtype=torch.long)]}, {}, "empty"),
        ({"input_ids": [torch.tensor([1, 259])]}, {}, r"token ids in \[0, 259\), got 259"),
        ({"input_ids": [torch.tensor([-1])]}, {}, "got -1"),
        ({"input_ids": [ok]}, {"max_tokens": 1022},
         r"prompt \(3 tokens\) \+ max_tokens \(1022\) = 1025 exceeds max_position_embeddings \(1024\)"),
        ({"input_ids": [ok]}, {"sampling": {"temperature": -1}}, "temperature must be"),
        ({"input_ids": [ok]}, {"sampling": {"bogus": 1}}, "unknown sampling parameter"),
        ({"input_ids": [ok]}, {"sampling": {"stop_token_ids": [600]}}, "outside the vocabulary"),
    ]
    for inputs, params, msg in cases:
        with pytest.raises(ValueError, match=msg):
            m.validate_request(inputs, params)
    with Runtime(m) as rt, pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        rt.submit({"input_ids": torch.ones(1020, dtype=torch.long)}, {"max_tokens": 10})


def test_tokenizers(tmp_path, tied_ckpt):
    tokenizers = pytest.importorskip("tokenizers")
    bt = ByteTokenizer()
    text = "naïve café ☕"
    assert bt.decode(bt.encode(text)) == text and max(bt.encode(text)) < TINY.vocab_size
    assert bt.encode("a", add_special_tokens=False) == [ord("a") + 3]
    # a checkpoint's tokenizer.json (a small word-level one here)
    _, ckpt = tied_ckpt
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    for f in ("config.json", "generation_config.json"):
        shutil.copy(ckpt / f, tmp_path / f)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello world") == [3, 4] and loaded.decode([1, 3, 4, 2]) == "hello world"
    assert loaded.eos_token_ids == (2,)
    with pytest.raises(CheckpointNotFoundError, match="no tokenizer.json"):
        load_tokenizer(ckpt)
