"""Orpheus's SNAC codec node: checkpoint loading, token -> code mapping, streaming parity with the
Orpheus reference decoder, batching and edge cases. Tiny random SNAC models only (no downloads)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from snac import SNAC
from snac.layers import NoiseBlock

from mstar.graph.chunking import SlidingWindowChunkPolicy
from mstar.model.submodule import EngineInputs, ForwardInfo
from mstar.models.orpheus.codec import (
    AUDIO_TOKEN_BASE,
    CODE_SIZE,
    OrpheusAudioTokens,
    is_audio_token,
    plan_chunk,
    tokens_to_codes,
)
from mstar.models.orpheus.loader import (
    SNAC_24KHZ_CONFIG,
    TINY_SNAC_CONFIG,
    SnacCheckpointError,
    dummy_snac,
    load_snac,
    remove_noise,
    samples_per_frame,
)
from mstar.models.orpheus.nodes import SnacDecoderNode
from mstar.runtime.engine import StatelessEngine, WorkItem

S = 16  # samples per frame of TINY_SNAC_CONFIG: vq_strides[0] * prod(decoder_rates) = 4 * 2 * 2


@pytest.fixture(scope="module")
def model() -> SNAC:
    return dummy_snac(seed=3)


@pytest.fixture
def node(model) -> SnacDecoderNode:
    return SnacDecoderNode(model)


def _save(tmp_path, model: SNAC, config: dict, state: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict() if state is None else state, tmp_path / "pytorch_model.bin")
    return tmp_path


def _random_codes(frames: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, CODE_SIZE, (1, k * frames), generator=gen) for k in (1, 2, 4)]


def _random_tokens(n: int, seed: int) -> list[int]:
    """n audio tokens with random codes, including the edge codes 0 and 4095."""
    rng = random.Random(seed)
    codes = [rng.randrange(CODE_SIZE) for _ in range(n)]
    for i in range(0, n, 5):
        codes[i] = 0 if i % 2 else CODE_SIZE - 1
    return [OrpheusAudioTokens.to_token(c, i) for i, c in enumerate(codes)]


def _pcm16(audio: torch.Tensor) -> torch.Tensor:
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16)


def _reference_stream(model: SNAC, tokens: list[int]) -> torch.Tensor:
    """The Orpheus reference streaming decoder, written out independently of mstar's code: at every
    count k = 28, 35, ... decode the last 28 tokens as 4 frames and keep the window's second frame."""
    pieces = []
    for k in range(28, len(tokens) + 1, 7):
        window = tokens[k - 28:k]
        ids = [t - AUDIO_TOKEN_BASE - ((k - 28 + j) % 7) * 4096 for j, t in enumerate(window)]
        c0, c1, c2 = [], [], []
        for f in range(4):
            fr = ids[7 * f:7 * f + 7]
            c0.append(fr[0])
            c1 += [fr[1], fr[4]]
            c2 += [fr[2], fr[3], fr[5], fr[6]]
        with torch.inference_mode():
            audio = model.decode([torch.tensor([c]) for c in (c0, c1, c2)])
        s = audio.shape[-1] // 4
        pieces.append(_pcm16(audio[0, 0, s:2 * s]))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int16)


def _chunks(tokens: list[int]) -> list:
    policy = SlidingWindowChunkPolicy(window=28, stride=7)
    out = []
    for t in tokens:
        out += policy.push([torch.tensor([t], dtype=torch.long)])
    return out + policy.finish()


def _info(chunk) -> dict:
    return {"start": chunk.start, "new_start": chunk.new_start, "is_final": chunk.is_final}


def _engine_inputs(node: SnacDecoderNode, requests: list[tuple[list, dict | None]]):
    """What StatelessEngine builds: per-request prepare_inputs, tensors concatenated on dim 0."""
    infos, prepared = [], []
    for i, (items, chunk) in enumerate(requests):
        info = ForwardInfo(f"r{i}", "snac_chunk", "snac_decoder", (), {}, 0,
                           {} if chunk is None else {"audio_token": chunk})
        infos.append(info)
        prepared.append(node.prepare_inputs("snac_chunk", info, {"audio_token": list(items)}))
    names = list(prepared[0].tensor_inputs)
    tensors = {n: torch.cat([ni.tensor_inputs[n] for ni in prepared], 0) for n in names}
    splits = {n: [ni.tensor_inputs[n].shape[0] for ni in prepared] for n in names}
    ei = EngineInputs(walks=["snac_chunk"] * len(requests), nodes=["snac_decoder"] * len(requests),
                      request_ids=[i.request_id for i in infos], infos=infos, splits=splits,
                      args=[ni.args for ni in prepared])
    return ei, tensors


def _decode_alone(node, request) -> torch.Tensor:
    ei, tensors = _engine_inputs(node, [request])
    return node.decode_kept(ei, **tensors)[0]


def _run(node, requests) -> list[torch.Tensor]:
    ei, tensors = _engine_inputs(node, requests)
    out = node.forward("snac_chunk", ei, **tensors)
    assert list(out) == ["audio"] and len(out["audio"]) == len(requests)
    return out["audio"]


# ------------------------------------------------------------------------------------------ loader
def test_load_snac_matches_original(tmp_path, model):
    loaded = load_snac(_save(tmp_path, model, TINY_SNAC_CONFIG))
    assert not loaded.training
    codes = _random_codes(5, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(loaded.decode(codes), model.decode(codes))


def test_load_snac_noise_override_and_legacy_weight_norm_names(tmp_path):
    noisy = dummy_snac(seed=1, noise=None, config={**TINY_SNAC_CONFIG, "noise": True})
    assert any(isinstance(m, NoiseBlock) for m in noisy.modules())
    # old torch.nn.utils.weight_norm names (weight_g / weight_v), as older SNAC checkpoints may use
    legacy = {}
    for k, v in noisy.state_dict().items():
        k = k.replace("parametrizations.weight.original0", "weight_g")
        legacy[k.replace("parametrizations.weight.original1", "weight_v")] = v
    assert any(k.endswith("weight_g") for k in legacy)
    path = _save(tmp_path, noisy, {**TINY_SNAC_CONFIG, "noise": True}, legacy)
    quiet = load_snac(path, noise=False)
    assert not any(isinstance(m, NoiseBlock) for m in quiet.modules())
    codes = _random_codes(2, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = quiet.decode(codes), quiet.decode(codes)
        assert torch.equal(a, b)  # deterministic without noise
        assert torch.equal(a, remove_noise(noisy).decode(codes))
    assert any(isinstance(m, NoiseBlock) for m in load_snac(path).modules())  # config's noise kept


def test_load_snac_errors(tmp_path, model):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_snac(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(TINY_SNAC_CONFIG))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_snac(tmp_path)
    state = dict(model.state_dict())
    dropped = next(iter(state))
    del state[dropped]
    _save(tmp_path, model, TINY_SNAC_CONFIG, state)
    with pytest.raises(SnacCheckpointError, match="Missing key"):
        load_snac(tmp_path)
    _save(tmp_path, model, {**TINY_SNAC_CONFIG, "decoder_dim": 64})
    with pytest.raises(SnacCheckpointError, match="size mismatch"):
        load_snac(tmp_path)
    _save(tmp_path, model, {**TINY_SNAC_CONFIG, "bogus": 1})
    with pytest.raises(SnacCheckpointError, match="bogus"):
        load_snac(tmp_path)
    _save(tmp_path, model, TINY_SNAC_CONFIG)  # noise requested but the config has none
    with pytest.raises(SnacCheckpointError, match="noise"):
        load_snac(tmp_path, noise=True)


def test_dummy_snac_is_deterministic_and_keeps_global_rng(model):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    other = dummy_snac(seed=3)
    assert torch.equal(torch.rand(3), expected)
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_samples_per_frame_from_decoded_length(model):
    assert samples_per_frame(model) == S
    with torch.inference_mode():
        assert model.decode(_random_codes(4, torch.Generator().manual_seed(2))).shape == (1, 1, 4 * S)
    # the real 24 kHz codec, shapes only (meta device: no weights, no compute)
    with torch.device("meta"):
        real = SNAC(**SNAC_24KHZ_CONFIG)
        assert samples_per_frame(real) == 2048
        for frames in (1, 4, 7):
            codes = [torch.zeros(1, k * frames, dtype=torch.long) for k in (1, 2, 4)]
            with torch.inference_mode():
                assert real.decode(codes).shape == (1, 1, 2048 * frames)


# ------------------------------------------------------------------------------------------ tokens
def test_tokens_to_codes_inverts_the_orpheus_encoding():
    frames = 6
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, CODE_SIZE, (frames, 7), generator=gen)
    codes[0, :] = 0
    codes[1, :] = CODE_SIZE - 1
    for start in (0, 21):
        tokens = [OrpheusAudioTokens.to_token(int(c), start + j) for j, c in enumerate(codes.reshape(-1))]
        assert all(is_audio_token(t) for t in tokens)
        assert [OrpheusAudioTokens.to_code(t, start + j) for j, t in enumerate(tokens)] == codes.reshape(-1).tolist()
        (c0, c1, c2), valid = tokens_to_codes(tokens + tokens[:3], start)  # trailing partial frame ignored
        assert valid
        assert c0.dtype == torch.long and c0.shape == (1, frames)
        assert c1.shape == (1, 2 * frames) and c2.shape == (1, 4 * frames)
        assert c0[0].tolist() == codes[:, 0].tolist()
        assert c1[0].tolist() == [int(codes[f, p]) for f in range(frames) for p in (1, 4)]
        assert c2[0].tolist() == [int(codes[f, p]) for f in range(frames) for p in (2, 3, 5, 6)]
    assert not is_audio_token(AUDIO_TOKEN_BASE - 1)
    (c0, c1, c2), valid = tokens_to_codes(tokens[:5], 0)
    assert valid and c0.shape == (1, 0) and c2.shape == (1, 0)
    with pytest.raises(ValueError, match="multiple of 7"):
        tokens_to_codes(tokens, 3)


@pytest.mark.parametrize("bad", [CODE_SIZE, -1, "text"])
def test_tokens_to_codes_flags_invalid_codes(bad):
    tokens = _random_tokens(14, seed=5)
    tokens[9] = 128000 if bad == "text" else OrpheusAudioTokens.to_token(bad, 9)
    _, valid = tokens_to_codes(tokens, 0)
    assert not valid
    assert tokens_to_codes(tokens[:7], 0)[1]  # the bad token is in the second frame only


# --------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("n_tokens", [70, 73])
def test_streaming_matches_orpheus_reference(model, node, n_tokens):
    tokens = _random_tokens(n_tokens, seed=6)
    chunks = _chunks(tokens)
    assert len(chunks) == 7 + (n_tokens % 7 > 0)
    out = [_run(node, [(c.items, _info(c))])[0] for c in chunks]
    assert all(a.dtype == torch.int16 and a.dim() == 1 for a in out)
    assert [a.numel() for a in out] == [S] * 7 + [0] * (n_tokens % 7 > 0)  # tail chunk emits nothing
    streamed = torch.cat(out)
    expected = _reference_stream(model, tokens)
    assert streamed.numel() == (n_tokens // 7 - 3) * S
    assert torch.equal(streamed, expected)
    assert node.num_invalid_windows == 0


def test_batch_of_windows_equals_each_alone(model, node, monkeypatch):
    streams = [_random_tokens(49, seed=s) for s in (7, 8, 9)]
    chunks = [_chunks(t)[i] for i, t in zip((0, 1, 3), streams, strict=True)]
    chunks.append(_chunks(_random_tokens(17, seed=10))[0])  # a short stream: 2 frames, decoded apart
    requests = [(c.items, _info(c)) for c in chunks]
    alone = [_decode_alone(node, r) for r in requests]
    calls = []
    decode = model.decode

    def counting(codes):
        calls.append(tuple(codes[0].shape))
        return decode(codes)

    monkeypatch.setattr(model, "decode", counting)
    ei, tensors = _engine_inputs(node, requests)
    batched = node.decode_kept(ei, **tensors)
    assert sorted(calls) == [(1, 2), (3, 4)]  # one decode for the 3 windows, one for the short stream
    pcm = node.forward("snac_chunk", ei, **tensors)["audio"]
    assert [a.numel() for a in batched] == [S, S, S, 2 * S]
    for b, a, p in zip(batched, alone, pcm, strict=True):
        # batched CPU convolutions are not bitwise identical to single ones (last-ulp differences), so
        # a sample that sits on a rounding boundary may move by one LSB in int16
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        assert torch.equal(p, _pcm16(b))
        assert (p.int() - _pcm16(a).int()).abs().max() <= 1


def test_stateless_engine_runs_the_node(node, model):
    tokens = _random_tokens(42, seed=11)
    items = [WorkItem(i, "r", "codec", "snac_chunk", 0, "snac_decoder", (), {"audio_token": list(c.items)},
                      {"audio_token": _info(c)}, {}, 0) for i, c in enumerate(_chunks(tokens))]
    engine = StatelessEngine(node)
    one_by_one = torch.cat([engine.run([item])[0]["audio"][0] for item in items])
    assert torch.equal(one_by_one, _reference_stream(model, tokens))
    together = torch.cat([out["audio"][0] for out in engine.run(items)])  # one batch of 3 windows
    assert list(engine.batch_sizes) == [1, 1, 1, 3]
    assert (together.int() - one_by_one.int()).abs().max() <= 1


def test_invalid_window_emits_silence_of_the_same_length(model, node):
    tokens = _random_tokens(42, seed=12)
    tokens[30] = OrpheusAudioTokens.to_token(CODE_SIZE, 30)  # out of range, in windows 1 and 2 (of 0..2)
    chunks = _chunks(tokens)
    good = _random_tokens(28, seed=13)
    out = [_run(node, [(c.items, _info(c)), (good, {"start": 0, "new_start": 0, "is_final": False})])
           for c in chunks]
    assert [o[0].numel() for o in out] == [S, S, S]
    assert torch.equal(out[0][0], _reference_stream(model, tokens[:28]))
    for o in out[1:]:
        assert torch.equal(o[0], torch.zeros(S, dtype=torch.int16))
    for o in out:  # the valid request of the same batch is unaffected
        assert torch.equal(o[1], _reference_stream(model, good))
    assert node.num_invalid_windows == 2


@pytest.mark.parametrize("n_tokens", [20, 5])
def test_short_stream_final_flush_decodes_all_whole_frames(model, node, n_tokens):
    tokens = _random_tokens(n_tokens, seed=14)
    chunks = _chunks(tokens)
    assert len(chunks) == 1 and chunks[0].is_final and chunks[0].start == chunks[0].new_start == 0
    (audio,) = _run(node, [(chunks[0].items, _info(chunks[0]))])
    frames = n_tokens // 7
    assert audio.numel() == frames * S
    if frames:
        with torch.inference_mode():
            expected = _pcm16(model.decode(tokens_to_codes(tokens, 0)[0])[0, 0])
        assert torch.equal(audio, expected)
    # without chunk information (a non-streamed input) the node decodes everything it is given
    (plain,) = _run(node, [([torch.tensor([t]) for t in tokens], None)])
    assert torch.equal(plain, audio)


def test_plan_chunk_rules():
    for start, new_start in ((0, 0), (14, 35)):  # windows
        p = plan_chunk(28, start, new_start, False)
        assert (p.num_frames, p.emit_from, p.emit_to) == (4, 1, 2)
    p = plan_chunk(28, 16, 42, True)  # tail after the last window
    assert (p.num_frames, p.emit_from, p.emit_to) == (0, 0, 0)
    p = plan_chunk(27, 0, 0, True)
    assert (p.num_frames, p.emit_from, p.emit_to) == (3, 0, 3)
    with pytest.raises(ValueError, match="SlidingWindowChunkPolicy"):
        plan_chunk(14, 7, 14, False)
