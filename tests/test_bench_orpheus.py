"""Smoke test of ``mstar bench orpheus``: structure and positive figures, no timing assertion."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from mstar.bench import orpheus_bench  # noqa: E402
from mstar.bench.orpheus_bench import SYSTEMS, format_table, run_orpheus_bench  # noqa: E402
from mstar.cli.main import main  # noqa: E402
from mstar.models.orpheus.loader import samples_per_frame  # noqa: E402


@pytest.fixture(scope="module")
def tiny_result():
    return run_orpheus_bench([2], tokens=35, warmup=False, hidden=64, layers=2, head_dim=16)


def test_orpheus_bench_smoke(tiny_result):
    res = tiny_result
    assert (res.tokens, res.hidden, res.layers, res.head_dim, res.workers) == (35, 64, 2, 16, "inline")
    [r] = res.results
    assert r.concurrency == 2 and set(r.systems) == set(SYSTEMS)
    for s in r.systems.values():
        assert s.concurrency == 2 and s.tokens_per_request == 35
        assert s.throughput > 0 and s.wall_s > 0 and s.audio_s_per_request > 0 and s.rtf_p50 > 0
        assert 0 < s.ttfa_p50_ms <= s.ttfa_p95_ms
        assert len(s.raw["ttfa_ms"]) == 2
    # 35 tokens = 5 frames: the stream emits frames 1..2, the baselines decode all 5 (unless a sampled
    # stop token cost a frame, which is rare)
    spf = res.samples_per_frame
    assert r.systems["mstar"].audio_s_per_request <= 2 * spf / 24000
    assert 4 * spf / 24000 <= r.systems["hf-static-batch"].audio_s_per_request <= 5 * spf / 24000
    assert set(r.throughput_ratio) == set(r.ttfa_ratio) == {"hf-sequential", "hf-static-batch"}
    assert all(v > 0 for v in [*r.throughput_ratio.values(), *r.ttfa_ratio.values()])
    table = format_table(res)
    assert "concurrency 2:" in table and "| mstar |" in table and "| hf-sequential |" in table


def test_orpheus_bench_cli(tiny_result, monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(concurrency, **kw):
        seen.update(kw, concurrency=concurrency)
        return tiny_result

    monkeypatch.setattr(orpheus_bench, "run_orpheus_bench", fake)
    out = tmp_path / "r.json"
    argv = ["bench", "orpheus", "--concurrency", "2,3", "--tokens", "35", "--hidden", "64", "--layers", "2",
            "--head-dim", "16", "--workers", "process", "--out", str(out)]
    assert main(argv) == 0
    assert seen["concurrency"] == [2, 3] and seen["workers"] == "process"
    assert (seen["tokens"], seen["hidden"], seen["layers"], seen["head_dim"]) == (35, 64, 2, 16)
    lines = capsys.readouterr().out.splitlines()
    assert "| hf-static-batch |" in "\n".join(lines)
    data = json.loads(lines[-1])
    assert data["results"][0]["concurrency"] == 2 and json.loads(out.read_text()) == data


# -- the vLLM + SNAC peer (mstar bench compare tts) -------------------------------------------------------
def test_keep_audio_codes_masks_all_but_the_position_codes_and_stop():
    from mstar.bench.peers.vllm_audio_codes import keep_audio_codes

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 200, generator=g)
    before = logits.clone()
    rows, lo, stop = torch.tensor([0, 3]), torch.tensor([10, 50]), torch.tensor([3, 199])
    keep_audio_codes(logits, rows, lo, 8, stop)
    for j, r in enumerate(rows.tolist()):
        allowed = set(range(int(lo[j]), int(lo[j]) + 8)) | {int(stop[j])}
        for c in range(200):
            want = before[r, c] if c in allowed else float("-inf")
            assert logits[r, c] == want, (r, c)
    for r in (1, 2, 4):
        assert torch.equal(logits[r], before[r])


def test_window_decoder_emits_what_the_mstar_stream_emits():
    """orpheus-tts's client-side decoder (the vLLM peer's) on mstar's tokens = mstar's streamed audio."""
    from mstar.bench.orpheus_systems import WindowDecoder
    from mstar.models.orpheus.model import OrpheusTiny
    from mstar.runtime.api import Runtime

    model = OrpheusTiny()
    with Runtime(model) as rt:
        [out] = rt.generate([{"input_ids": torch.tensor(model.prompt_ids("Hello there.", "tara"))}],
                            {"max_tokens": 63, "sampling": {"seed": 5, "ignore_eos": True}})
        snac_model = rt.local_module("snac_decoder").snac
    assert out.finished, out.error
    tokens = [int(t) for t in out.tensors("token")]
    streamed = torch.cat(out.tensors("audio"))
    dec = WindowDecoder(snac_model, samples_per_frame(snac_model))
    pieces = [p for p in (dec.push(t) for t in tokens) if p is not None]
    assert dec.tokens == len(tokens) == 63
    assert len(pieces) == 9 - 3  # 9 frames: frames 1..6 emitted
    mine = torch.cat(pieces)
    assert mine.shape == streamed.shape
    assert int((mine.int() - streamed.int()).abs().max()) <= 1  # windows batched in one SNAC call: float noise


FAKE_PEER = r'''
import argparse, json, sys
ap = argparse.ArgumentParser()
for a in ("--model", "--max-num-seqs", "--max-model-len", "--dtype"):
    ap.add_argument(a)
ap.add_argument("--audio-constraint", action="store_true")
args = ap.parse_args()
print(json.dumps({"ready": True, "vllm": "fake"}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "quit":
        break
    if cmd.get("audio_codes") and not args.audio_constraint:
        print(json.dumps({"error": "no --audio-constraint"}), flush=True)
        continue
    spec, n = cmd["audio_codes"], cmd["max_tokens"]
    for k in range(n):  # one token per request per step: code k % 4096 at position k % 7
        step = [[i, [spec["base"] + (k % spec["frame"]) * spec["size"] + (k + i) % spec["size"]]]
                for i in range(len(cmd["prompts"]))]
        print(json.dumps({"step": step}), flush=True)
    print(json.dumps({"wall_s": 0.0}), flush=True)
'''


@pytest.fixture()
def fake_peer(tmp_path, monkeypatch):
    import os
    import sys

    from mstar.bench import llm_systems

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "venv" / "bin" / "python")
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setattr(llm_systems, "PEER_SCRIPT", script)
    (tmp_path / "ckpt").mkdir()
    peer = llm_systems.VllmSystem(tmp_path / "ckpt", tmp_path / "venv", audio_constraint=True)
    yield peer
    peer.close()
    assert peer.proc.poll() is not None


def test_vllm_stream_protocol_and_an_early_stop(fake_peer):
    from mstar.bench.orpheus_systems import audio_codes_spec

    gen = fake_peer.stream([[1], [2]], 5, {"temperature": 0.6}, audio_codes_spec())
    assert next(gen)[0] == 0
    gen.close()  # the rest of that stream is read and dropped
    got = list(fake_peer.stream([[1], [2]], 3, {}, audio_codes_spec()))
    assert [i for i, _ in got] == [0, 1] * 3 and all(len(ids) == 1 for _, ids in got)


def test_run_vllm_snac_times_and_counts_each_request(fake_peer):
    from mstar.bench.orpheus_systems import run_vllm_snac
    from mstar.models.orpheus.loader import dummy_snac

    snac_model = dummy_snac()
    spf = samples_per_frame(snac_model)
    run = run_vllm_snac(fake_peer, snac_model, [[1], [2]], 42, spf)  # 6 frames: frames 1..3 emitted
    assert len(run.requests) == 2
    for r in run.requests:
        assert r.tokens == 42 and r.audio_samples == 3 * spf
        assert 0 < r.ttfa_s <= r.end_s <= run.wall_s


def test_compare_tts_runs_the_orpheus_bench_with_vllm(tiny_result, monkeypatch, capsys):
    from mstar.bench.orpheus_bench import VLLM

    seen = {}

    def fake(concurrency, **kw):
        seen.update(kw, concurrency=concurrency)
        return tiny_result

    monkeypatch.setattr(orpheus_bench, "run_orpheus_bench", fake)
    assert main(["bench", "compare", "tts", "--levels", "4,2", "--sampler", "temperature"]) == 0
    assert seen["concurrency"] == [2, 4] and VLLM in seen["systems"] and seen["sampler"] == "temperature"
    assert seen["head"] == "full"  # the other systems' arithmetic
    assert (seen["tokens"], seen["hidden"], seen["layers"]) == (140, 256, 4)
    assert "concurrency 2:" in capsys.readouterr().out
