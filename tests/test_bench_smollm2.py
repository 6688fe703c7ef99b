"""``mstar bench compare llm --model smollm2`` (alias ``--workload smollm2``): the option reaches the bench,
and a GGUF file is written once as the HF-layout fp32 directory every compared system reads (checked
on a tiny GGUF; the real run is not part of the suite)."""

from __future__ import annotations

import json

import pytest
import torch

from mstar.bench import llm_bench as lb
from mstar.cli.main import build_parser

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


def test_model_option_parses_and_reaches_the_bench(monkeypatch):
    parse = build_parser().parse_args
    assert parse(["bench", "compare", "llm"]).model == "random"
    for flag in ("--model", "--workload"):
        args = parse(["bench", "compare", "llm", flag, "smollm2", "--workloads", "b1"])
        assert (args.model, args.workloads) == ("smollm2", "b1")
    with pytest.raises(SystemExit):
        parse(["bench", "compare", "llm", "--model", "nope"])
    seen = {}

    class Stop(Exception):
        pass

    def fake_bench(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(lb, "run_llm_bench", fake_bench)
    args = parse(["bench", "compare", "llm", "--workload", "smollm2", "--systems", "mstar,hf"])
    with pytest.raises(Stop):
        args.func(args)
    assert seen["model"] == "smollm2" and seen["systems"] == ["mstar", "hf"]
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        lb.model_checkpoint("nope", None, lb.BENCH_SHAPE, 0)


def test_gguf_is_written_once_as_an_hf_fp32_directory(tmp_path):
    from mstar.bench.smollm2_checkpoint import ensure_smollm2_checkpoint, smollm2_shape
    from mstar.models.llama.config import LlamaConfig
    from mstar.models.llama.loader import build_llama_model
    from tests.test_gguf import _hf_model, write_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(_hf_model(True, seed=7), gguf_path)
    lines = []
    path = ensure_smollm2_checkpoint(tmp_path / "cache", gguf_path, log=lines.append)
    assert (path / "model.safetensors").is_file() and len(lines) == 1
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "float32" and cfg["rope_theta"] == 10000.0
    # what the GGUF loader gives is what HF transformers and mstar read from the directory
    ours = build_llama_model(LlamaConfig.from_pretrained(gguf_path), model_path=gguf_path).state_dict()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    again = build_llama_model(LlamaConfig.from_pretrained(path), model_path=path).state_dict()
    assert set(hf) == set(ours) == set(again)
    assert all(torch.equal(hf[k], ours[k]) and torch.equal(again[k], ours[k]) for k in ours)
    assert smollm2_shape(path) == smollm2_shape(gguf_path)
    assert smollm2_shape(path).vocab_size == 512
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_smollm2_checkpoint(tmp_path / "cache", gguf_path, log=lines.append) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp and len(lines) == 1  # reused
    write_gguf(_hf_model(True, seed=8), gguf_path)  # the source changed: written again
    ensure_smollm2_checkpoint(tmp_path / "cache", gguf_path, log=lines.append)
    assert len(lines) == 2
