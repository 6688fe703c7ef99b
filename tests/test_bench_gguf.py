"""``mstar bench compare gguf``'s parts that run without peers: the file conversions (checked by
loading them), the logits helper, the llama.cpp build switches, the tables and goals, bad arguments."""

from __future__ import annotations

import pytest
import torch

from mstar.bench import gguf_bench as g
from mstar.bench import gguf_systems
from mstar.bench.llm_bench import compare_tokens
from mstar.bench.llm_systems import PeerUnavailable
from mstar.bench.peers.llama_cpp_flags import cmake_args
from mstar.model.gguf_file import GGUFFile
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.loader import build_llama_model
from tests import test_gguf
from tests.test_gguf_stored import STORED_TYPES
from tests.test_llama import PagedBatcher

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "tiny.Q4.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_gguf, "LAYER_TYPES", STORED_TYPES)
        test_gguf.write_gguf(test_gguf._hf_model(True, seed=2), path)
    return path


@pytest.mark.parametrize("kind", ["Q8_0", "F16"])
def test_conversions_keep_the_metadata_and_the_values(source, tmp_path, kind):
    target = gguf_systems.convert(source, tmp_path / f"tiny.{kind}.gguf", kind)
    src, out = GGUFFile(source), GGUFFile(target)
    assert LlamaConfig.from_pretrained(target) == LlamaConfig.from_pretrained(source)
    assert {k: v for k, v in out.metadata.items() if k != "general.file_type"} == \
        {k: v for k, v in src.metadata.items() if k != "general.file_type"}
    for name in src.tensor_names:
        want = "F32" if len(src.shape(name)) == 1 else kind
        assert out.type_name(name) == want, name
        # the source's values, requantized: within Q8_0's step (1/127 of a block's largest value) or f16's
        tol = 1.01 / 127 if kind == "Q8_0" else 1e-3
        ref = src.tensor(name)
        assert (out.tensor(name) - ref).abs().max() <= tol * ref.abs().max() + 1e-6, name
    config = LlamaConfig.from_pretrained(target)
    ids = [1, 17, 33, 100, 200, 7]
    a = g.prompt_logits(build_llama_model(config, model_path=source), ids)
    b = g.prompt_logits(build_llama_model(config, model_path=target), ids)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    if kind == "Q8_0":  # a Q8_0 file is kept as stored
        assert build_llama_model(config, model_path=target, weights_as_stored=True).model.layers[0].self_attn.stored


def test_prompt_logits_match_a_paged_prefill(source):
    module = build_llama_model(LlamaConfig.from_pretrained(source), model_path=source, weights_as_stored=True)
    ids = list(range(1, 40))  # more than one KV block
    ref = PagedBatcher(module).step(module, {0: ids})
    assert torch.equal(g.prompt_logits(module, ids), ref)


def test_llama_cpp_switches_follow_the_cpu():
    avx2 = cmake_args({"avx", "avx2", "fma", "f16c"})
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    full = cmake_args({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"})
    assert "-DGGML_AVX512_VNNI=ON" in full and "-DGGML_AMX_INT8=OFF" in full  # AMX stays off (module doc)


def test_bad_arguments_and_a_missing_peer(tmp_path):
    with pytest.raises(ValueError, match="unknown systems"):
        g.run_gguf_bench(systems=["mstar-q4_1", "llama.cpp-q2_k"])
    with pytest.raises(ValueError, match="concurrency"):
        g.run_gguf_bench(concurrency=17)
    with pytest.raises(PeerUnavailable, match="make bench-peers"):
        gguf_systems.LlamaCppSystem("llama.cpp-q4_1", tmp_path / "x.gguf", tmp_path / "no-venv", 16, 2, tmp_path)


def _run(tok_s, tokens):
    from mstar.bench.llm_systems import Run

    return Run(wall_s=sum(len(t) for t in tokens) / tok_s, tokens=tokens, request_s=[1.0] * len(tokens))


def test_tables_and_goals():
    ours, theirs = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    runs = {("mstar-q4_1", "b1"): [_run(90.0, ours)], ("llama.cpp-q4_1", "b1"): [_run(60.0, theirs)],
            ("mstar-q4_1", "concurrent"): [_run(500.0, ours)], ("llama.cpp-q4_1", "concurrent"): [_run(300.0, theirs)]}
    stats = g._stats(runs)
    files = {"q4_1": {"path": "a", "bytes": 100 * 2**20}, "q8_0": {"path": "b", "bytes": 140 * 2**20}}
    memory = {"mstar-q4_1": {"weight_bytes": 99 * 2**20, "rss_load_kib": {"RssAnon": 150 * 1024, "RssFile": 0}},
              "llama.cpp-q4_1": {"model_bytes": 98 * 2**20, "rss_load_kib": {"RssAnon": 50 * 1024, "RssFile": 90 * 1024}}}
    parity = [g._parity("mstar-q4_1", [torch.tensor([[1.0, 2.0]])], [torch.tensor([[1.0, 2.5]])])]
    res = g.GgufBenchResult(max_tokens=3, concurrency=2, b1_requests=2, repeats=1, prompt_lengths=[5, 6], files=files,
                            stats=stats, memory=memory, parity=parity, llama_cpp="0.3.36", llama_cpp_system="CPU : AVX2 = 1 |",
                            vllm=None, skipped=[], cores=2, threads=2, date="2026-12-07")
    table = g.format_table(res)
    assert "| batch 1 (2 in turn) | llama.cpp-q4_1 | 60.0 (60.0–60.0)" in table and "mstar-q4_1: 1.50x" in table
    assert compare_tokens(ours, theirs).describe() in table
    assert "| mstar-q4_1 | Q4_1 | 100.0 | 99.0 | 0.99 | 150 + 0 |" in g.format_memory(res)
    assert "| mstar-q4_1 | 0.500 | 0.2000 | 100.0% |" in g.format_parity(res)
    checks = dict(g.goal_checks(res))
    assert list(checks.values()) == [True, False, True]  # b1 1.5x >= 1; concurrent 1.67x < 2; memory 0.99
    assert "llama-cpp-python 0.3.36" in g.describe(res)
