"""Qwen3-Omni parts against transformers on a tiny random config (fp32, CPU): Code2Wav and its
chunk stitching, and the Talker prompt (the code predictor is checked with the talker, in
test_qwen3_omni_model.py and test_qwen3_omni_runtime.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from mstar.graph.chunking import LeftContextChunkPolicy
from mstar.model.checkpoint import CheckpointError
from mstar.models.qwen3_omni import prompt as P
from mstar.models.qwen3_omni.code2wav import WEIGHT_PREFIX, ChunkRequest, Code2Wav, to_pcm16

HIDDEN, HEAD_DIM, CODEBOOK, GROUPS = 64, 16, 64, 16
IS, IE, NL, SYSTEM, USER, ASSISTANT = 151644, 151645, 198, 8948, 872, 77091
AUDIO, IMAGE = 151675, 151655


def tiny_hf_config() -> Qwen3OmniMoeConfig:
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True,
            "mrope_interleaved": True}
    decoder = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, norm_topk_prob=True, rope_parameters=rope,
                   max_position_embeddings=4096)
    special = dict(audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=151656,
                   vision_start_token_id=151652, audio_start_token_id=151669, position_id_per_seconds=13)
    cb = CODEBOOK
    thinker = dict(
        text_config=dict(vocab_size=152064, **decoder),
        audio_config=dict(encoder_layers=1, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64,
                          downsample_hidden_size=16, output_dim=HIDDEN),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
                           deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
        vision_end_token_id=151653, audio_end_token_id=151670, **special)
    predictor = dict(vocab_size=cb, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, num_code_groups=GROUPS,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    talker = dict(
        text_config=dict(vocab_size=cb + 1024, shared_expert_intermediate_size=64, **decoder),
        code_predictor_config=predictor, num_code_groups=GROUPS, thinker_hidden_size=HIDDEN,
        accept_hidden_layer=1, spatial_merge_size=2, codec_pad_id=cb + 100, codec_bos_id=cb + 101,
        codec_eos_token_id=cb + 102, codec_nothink_id=cb + 107, codec_think_bos_id=cb + 108,
        codec_think_eos_id=cb + 109, speaker_id={"chelsie": cb + 253, "ethan": cb + 254, "aiden": cb + 255},
        **special)
    code2wav = dict(codebook_size=cb, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=64, num_hidden_layers=1, num_quantizers=GROUPS, sliding_window=72,
                    upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav)


@pytest.fixture(scope="module")
def hf():
    """Seeded, with the talker's MoE weights drawn too (transformers leaves them uninitialised; see
    ``loader.hf_reference_model``)."""
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_hf_config()).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.talker.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight):
                p.copy_(torch.randn(p.shape, generator=gen) * model.config.initializer_range)
    return model


@pytest.fixture(scope="module")
def checkpoint(hf, tmp_path_factory):
    """The tiny model's tensors as transformers saves them (hub names)."""
    path = tmp_path_factory.mktemp("qwen3_omni_tiny")
    hf.save_pretrained(path)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.fixture(scope="module")
def code2wav(hf, checkpoint):
    module = Code2Wav(hf.config.code2wav_config)
    module.load_weights(checkpoint)
    return module


def _codes(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CODEBOOK, (batch, GROUPS, frames), generator=gen)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error (the tiny random codec's waveforms are ~1e-6 in amplitude)."""
    return ((a - b).norm() / b.norm()).item()


def _stream(code2wav: Code2Wav, codes: torch.Tensor, chunk: int, left_context: int) -> list[torch.Tensor]:
    """Decode ``codes`` ``[Q, T]`` as the runtime streams it: frames through a LeftContextChunkPolicy."""
    policy = LeftContextChunkPolicy(chunk=chunk, left_context=left_context)
    chunks = policy.push(list(codes.T)) + policy.finish()
    return [code2wav.decode_chunk(torch.stack(c.items, dim=1)[None], c.num_context)[0] for c in chunks]


# ------------------------------------------------------------------------------------------ Code2Wav


@pytest.mark.parametrize("frames", [1, 2, 13])
def test_code2wav_full_decode_equals_transformers(hf, code2wav, frames):
    codes = _codes(frames, seed=frames)
    with torch.no_grad():
        ref = hf.code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25)[0, 0]
    ours = code2wav.decode(codes)[0]
    assert ours.shape[0] == code2wav.wave_length(frames) == 1920 * frames - 555
    assert _relative(ours, ref) < 1e-5  # the swapped modules sum in another order (fast_modules test)


@pytest.mark.parametrize("kernel", [True, False], ids=["compiled", "torch"])
def test_code2wav_fast_modules_equal_transformers_modules(hf, monkeypatch, kernel):
    """The swapped kernel-1 convolutions and SnakeBeta activations (compiled, and their PyTorch path)
    against transformers' own modules, on weights with audible magnitudes (the tiny checkpoint's
    waveform is ~1e-6, where both round alike)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    import mstar.models.qwen3_omni.code2wav as c2w

    if not kernel:
        monkeypatch.setattr(c2w.kernels, "ops", lambda: None)
    torch.manual_seed(5)
    ref = Qwen3OmniMoeCode2Wav(hf.config.code2wav_config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("alpha", "beta")):
                p.normal_(0.0, 0.3)
            elif p.dim() > 1:
                p.normal_(0.0, 0.5 / p[0].numel() ** 0.5)
    ours = Code2Wav(hf.config.code2wav_config)
    ours.model.load_state_dict(ref.state_dict())
    swapped = {type(m).__name__ for m in ours.model.modules()}
    assert {"_PointwiseConv1d", "_NarrowConv1d", "_SnakeBeta"} <= swapped
    assert "Qwen3OmniMoeSnakeBeta" not in swapped
    codes = _codes(9, seed=3)
    with torch.no_grad():
        want = ref(codes)[:, 0]
    got = ours.decode(codes)
    assert 1e-3 < want.abs().max() < 1  # far above rounding noise; not clamped
    assert _relative(got, want) < 1e-5


def test_code2wav_snake_scales_follow_a_weight_load(hf, checkpoint):
    """The activations keep exp(alpha) and 1 / exp(beta) between calls; a load of other weights after
    a decode must reach them (a stale cache would decode with the first weights' activations)."""
    torch.manual_seed(7)
    drawn = {k: (torch.randn_like(v) * 0.3 if k.endswith(("alpha", "beta")) else v) for k, v in checkpoint.items()}
    fresh = Code2Wav(hf.config.code2wav_config)
    fresh.load_weights(drawn)
    reused = Code2Wav(hf.config.code2wav_config)
    reused.load_weights(checkpoint)
    codes = _codes(6, seed=2)
    before = reused.decode(codes)
    reused.load_weights(drawn)
    after, want = reused.decode(codes), fresh.decode(codes)
    assert not torch.equal(before, want)
    assert torch.equal(after, want)


def test_code2wav_stream_has_exact_length_and_matches_full_decode(code2wav):
    codes = _codes(60, seed=1)[0]
    full = code2wav.decode(codes[None])[0]
    parts = _stream(code2wav, codes, chunk=25, left_context=25)
    assert [p.shape[0] for p in parts] == [1920 * 25 - 555, 1920 * 25, 1920 * 10]
    streamed = torch.cat(parts)
    assert streamed.shape == full.shape == (1920 * 60 - 555,)
    # the first chunk is the full decode's start exactly; later chunks see 25 of the 72 frames the
    # pre-transformer's window spans, so they differ slightly (relative L2 ~2e-3 on this model)
    assert _relative(parts[0], full[: parts[0].shape[0]]) < 1e-5
    assert 0 < _relative(streamed, full) < 1e-2


def test_code2wav_stream_with_the_receptive_field_as_context_equals_full_decode(code2wav):
    """``exact_left_context`` (71 + 10 frames here) of context: every stateless chunk is exact, and
    the convolutions still see only the last 10 context frames."""
    assert code2wav.exact_left_context == 81
    codes = _codes(100, seed=2)[0]
    full = code2wav.decode(codes[None])[0]
    streamed = torch.cat(_stream(code2wav, codes, chunk=9, left_context=code2wav.exact_left_context))
    assert streamed.shape == full.shape
    assert _relative(streamed, full) < 1e-5


def _stream_exact(code2wav: Code2Wav, codes: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    stream, parts, start = code2wav.new_stream(), [], 0
    for n in sizes:
        parts += code2wav.decode_streams([stream], [codes[:, start:start + n]])
        start += n
    return parts


def test_code2wav_stream_follows_weights_given_new_storage(hf, checkpoint):
    """The streaming vocoder keeps its weights in the kernels' layout (and packed taps) between calls;
    weights assigned as ``param.data = w`` (no version bump, new storage) must reach them too."""
    torch.manual_seed(11)
    drawn = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in checkpoint.items()}
    fresh = Code2Wav(hf.config.code2wav_config)
    fresh.load_weights(drawn)
    reused = Code2Wav(hf.config.code2wav_config)
    reused.load_weights(checkpoint)
    codes = _codes(12, seed=4)[0]
    before = torch.cat(_stream_exact(reused, codes, [5, 7]))
    names = dict(reused.model.named_parameters())
    for name, p in names.items():
        p.data = drawn[WEIGHT_PREFIX + name].clone()
    after, want = torch.cat(_stream_exact(reused, codes, [5, 7])), torch.cat(_stream_exact(fresh, codes, [5, 7]))
    assert not torch.equal(before, want)
    assert torch.equal(after, want)


@pytest.mark.parametrize("sizes", [[10, 10, 10], [1, 12, 17]])
def test_code2wav_exact_stream_equals_full_decode(code2wav, sizes):
    codes = _codes(30, seed=7)[0]
    full = code2wav.decode(codes[None])[0]
    parts = _stream_exact(code2wav, codes, sizes)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    assert [p.shape[0] for p in parts] == [code2wav.wave_length(e) - code2wav.wave_length(e - n)
                                           for e, n in zip(ends, sizes)]
    assert _relative(torch.cat(parts), full) < 1e-5
    # stateless chunks of the same frames (10 recomputed context frames) are far further off
    assert _relative(torch.cat(_stream(code2wav, codes, chunk=10, left_context=10)), full) > 1e-4


def test_code2wav_exact_streams_batch_together(code2wav):
    codes = [_codes(16, seed=s)[0] for s in (10, 11, 12)]
    alone = [_stream_exact(code2wav, c, [8, 8]) for c in codes]
    streams = [code2wav.new_stream() for _ in codes]
    first = code2wav.decode_streams(streams, [c[:, :8] for c in codes])
    second = code2wav.decode_streams(streams[:2], [codes[0][:, 8:], codes[1][:, 8:]])
    second += code2wav.decode_streams(streams[2:], [codes[2][:, 8:]])
    for i in range(3):
        assert torch.equal(first[i], alone[i][0]) and torch.equal(second[i], alone[i][1])


def _audible_code2wav(config, seed: int) -> Code2Wav:
    """A Code2Wav with weights of audible magnitude (the tiny checkpoint's waveform is ~1e-6)."""
    module = Code2Wav(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if name.endswith(("alpha", "beta")):
                p.normal_(0.0, 0.3)
            elif p.dim() > 1:
                p.normal_(0.0, 0.5 / p[0].numel() ** 0.5)
    return module


@pytest.mark.parametrize("decoder_dim", [64, 128], ids=["tiny-widths", "kernel-widths"])
@pytest.mark.parametrize("kernel", [True, False], ids=["compiled", "torch"])
def test_code2wav_next_chunks_decode_together_bit_for_bit(hf, monkeypatch, decoder_dim, kernel):
    """``decode_next_many``: first chunks of two lengths, then continuing chunks mixed with a first one,
    give every request the same bits (samples and kept tails) as decoding it alone, and the streams
    equal full decodes. With the compiled kernels the groups run as batches (decoder 128: every
    convolution in ``narrow_conv1d``; 64: its 4-channel stage one row at a time); without, one
    request at a time through the PyTorch fallbacks of each step."""
    import mstar.models.qwen3_omni.code2wav as c2w
    from mstar.models.qwen3_omni.code2wav import NextChunk

    real = c2w.kernels.ops()
    batches: list[int] = []
    units: list[int] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def narrow_conv1d(self, x, *args):
            batches.append(x.shape[0])
            return real.narrow_conv1d(x, *args)

        def residual_unit(self, x, *args):
            batches.append(x.shape[0])
            units.append(x.shape[1])
            return real.residual_unit(x, *args)

    monkeypatch.setattr(c2w.kernels, "ops", (lambda: Recording()) if kernel else (lambda: None))
    if not kernel:
        monkeypatch.setattr(c2w.cpu_ops, "ops", lambda: None)
    config = dict(hf.config.code2wav_config.to_dict(), decoder_dim=decoder_dim)
    module = _audible_code2wav(config, seed=decoder_dim)
    codes = [_codes(14, seed=40 + i)[0] for i in range(4)]
    cuts = [6, 6, 4, 6]  # first chunks: three of 6 frames, one of 4
    firsts = [NextChunk(c[:, :n], 0, None) for c, n in zip(codes, cuts)]
    together = module.decode_next_many(firsts)
    alone = [module.decode_next(f.codes, 0, None) for f in firsts]
    later = [NextChunk(codes[0][:, :11], 6, together[0][1]), NextChunk(codes[1][:, :11], 6, together[1][1]),
             NextChunk(codes[2][:, :7], 4, together[2][1]), NextChunk(codes[3][:, :5], 0, None)]
    together2 = module.decode_next_many(later)
    alone2 = [module.decode_next(c.codes, c.left_context, s) for c, (_, s) in
              zip(later, [alone[0], alone[1], alone[2], (None, None)])]
    for (wave, state), (want, want_state) in zip(together + together2, alone + alone2):
        assert torch.equal(wave, want)
        assert state.frames == want_state.frames and state.tails.keys() == want_state.tails.keys()
        assert all(torch.equal(state.tails[k], want_state.tails[k]) for k in state.tails)
    if kernel:
        assert max(batches) == 3  # the three 6-frame first chunks (and the two 5-frame continuations)
        # residual units of 8 or 16k channels ran as one pass (decoder 64's 4-channel stage: three kernels)
        assert sorted(set(units)) == ([8, 16, 32, 64] if decoder_dim == 128 else [8, 16, 32])
        # the first decoder block's transposed convolution over < 32 steps ran as a panel multiply
        assert any(isinstance(key, tuple) and key[0] == "linear" for key in module._taps)
        # the ConvNeXt blocks' pointwise layers ran as packed panel linears over the steps' rows
        assert sum(key[0] == "panel" for key in module._taps if isinstance(key, tuple)) == 2 * len(module.model.upsample)
    full = module.decode(torch.stack(codes[:2]))
    for i in range(2):
        streamed = torch.cat([together[i][0], together2[i][0]])
        assert streamed.shape[0] == module.wave_length(11)
        assert 1e-3 < full[i].abs().max() < 1  # audible, not clamped
        assert _relative(streamed, full[i, :streamed.shape[0]]) < 1e-5
    # a weight changed in place after the first decodes (a reload) is used, not a stale packed copy
    with torch.no_grad():
        module.model.pre_transformer.layers[0].mlp.down_proj.weight.mul_(3.0)
    fresh = Code2Wav(config)
    fresh.model.load_state_dict(module.model.state_dict())
    changed = module.decode_next(firsts[0].codes, 0, None)[0]
    assert not torch.equal(changed, together[0][0])
    assert torch.equal(changed, fresh.decode_next(firsts[0].codes, 0, None)[0])


def test_code2wav_residual_units_in_one_pass_have_the_three_kernel_bits(hf, monkeypatch):
    """The vocoder's residual units through ``residual_unit`` (one pass) give the samples and kept
    tails of the three-kernel form, for first chunks and continuing ones, alone and batched."""
    import mstar.models.qwen3_omni.code2wav as c2w
    from mstar.models.qwen3_omni.code2wav import NextChunk
    from mstar.models.qwen3_omni.code2wav_batch import BatchVocoder

    if c2w.cpu_ops.ops() is None or c2w.kernels.ops() is None:
        pytest.skip("the compiled CPU kernels are unavailable here")

    module = _audible_code2wav(dict(hf.config.code2wav_config.to_dict(), decoder_dim=128), seed=5)
    codes = [_codes(12, seed=60 + i)[0] for i in range(3)]
    results = {}
    for name, fuse in (("fused", True), ("three", False)):
        monkeypatch.setattr(BatchVocoder, "fuse_units", fuse)
        firsts = module.decode_next_many([NextChunk(c[:, :5], 0, None) for c in codes])
        later = module.decode_next_many([NextChunk(c[:, :12], 5, state) for c, (_, state) in zip(codes, firsts)])
        results[name] = firsts + later
    for (wave, state), (want, want_state) in zip(results["fused"], results["three"]):
        assert torch.equal(wave, want) and state.tails.keys() == want_state.tails.keys()
        assert all(torch.equal(state.tails[k], want_state.tails[k]) for k in state.tails)


@pytest.mark.parametrize("frames", [1, 5, 50])
def test_code2wav_pre_transformer_rows_are_batch_invariant(hf, frames):
    """The pre-transformer's batch (one attention call for every request) gives each request the
    bits it gets alone, and matches transformers' module to float rounding."""
    module = _audible_code2wav(hf.config.code2wav_config.to_dict(), seed=9)
    embeds = module._embed(_codes(frames, seed=70, batch=4))
    if not module._pre.usable(embeds):
        pytest.skip("the compiled CPU kernels are unavailable here")
    together = module._pre(embeds)
    for b in range(4):
        assert torch.equal(module._pre(embeds[b:b + 1].contiguous()), together[b:b + 1])
        ref = module.model.pre_transformer(inputs_embeds=embeds[b:b + 1]).last_hidden_state
        torch.testing.assert_close(together[b:b + 1], ref, atol=1e-5, rtol=1e-4)


def test_code2wav_batched_chunks_equal_chunks_alone(code2wav):
    chunks = [ChunkRequest(_codes(16, seed=3)[0], 8), ChunkRequest(_codes(7, seed=4)[0], 0),
              ChunkRequest(_codes(16, seed=5)[0], 8), ChunkRequest(_codes(12, seed=6)[0], 8)]
    batched = code2wav.decode_chunks(chunks)
    for chunk, wave in zip(chunks, batched):
        alone = code2wav.decode_chunk(chunk.codes[None], chunk.left_context)[0]
        assert wave.shape == alone.shape
        assert _relative(wave, alone) < 1e-5
    assert [w.shape[0] for w in batched] == [1920 * 8, 1920 * 7 - 555, 1920 * 8, 1920 * 4]


def test_code2wav_rejects_bad_codes_and_mismatched_weights(code2wav, checkpoint):
    with pytest.raises(ValueError, match="codes must be"):
        code2wav.decode(torch.zeros(1, GROUPS - 1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="codes must lie"):
        code2wav.decode(torch.full((1, GROUPS, 4), CODEBOOK))
    with pytest.raises(ValueError, match="left_context"):
        ChunkRequest(_codes(5, seed=0)[0], 5)
    broken = {k: v for k, v in checkpoint.items() if not k.endswith("decoder.6.conv.weight")}
    with pytest.raises(CheckpointError, match="missing"):
        Code2Wav(code2wav.config).load_weights(broken)


def test_to_pcm16_scales_and_clamps():
    pcm = to_pcm16(torch.tensor([0.0, 0.5, -1.0, 1.0, 2.0]))
    assert pcm.dtype == torch.int16
    assert pcm.tolist() == [0, 16384, -32767, 32767, 32767]


# -------------------------------------------------------------------------------------- Talker prompt


def _talker_inputs(hf, monkeypatch, input_ids: torch.Tensor, speaker: str):
    """Run the reference's generate and record the Thinker's result and the Talker's inputs."""
    seen = {}
    thinker_generate, talker_generate = hf.thinker.generate, hf.talker.generate

    def thinker(*args, **kwargs):
        seen["thinker"] = thinker_generate(*args, **kwargs)
        return seen["thinker"]

    def talker(*args, **kwargs):
        seen["talker"] = kwargs
        return talker_generate(*args, **kwargs)

    monkeypatch.setattr(hf.thinker, "generate", thinker)
    monkeypatch.setattr(hf.talker, "generate", talker)
    with torch.no_grad():
        hf.generate(input_ids=input_ids, speaker=speaker, return_audio=True, thinker_max_new_tokens=6,
                    thinker_do_sample=False, talker_max_new_tokens=4, talker_do_sample=False)
    return seen["thinker"], seen["talker"]


def _projections(hf):
    talker = hf.talker
    return dict(text_projection=talker.text_projection, hidden_projection=talker.hidden_projection,
                codec_embedding=talker.get_input_embeddings())


def test_talker_prompt_equals_transformers(hf, monkeypatch):
    ids = P.OmniTokenIds.from_hf(hf.config)
    prompt = torch.tensor([IS, SYSTEM, NL, 100, 101, IE, NL, IS, USER, NL, 9707, 11, 1879, IE, NL,
                           IS, ASSISTANT, NL, 5, 6, IE, NL, IS, USER, NL, 77, IE, NL, IS, ASSISTANT, NL])
    result, talker = _talker_inputs(hf, monkeypatch, prompt[None], "Aiden")
    layer = hf.config.talker_config.accept_hidden_layer
    embed = torch.cat([h[0] for h in result.hidden_states], dim=1)[0]
    hidden = torch.cat([h[layer] for h in result.hidden_states], dim=1)[0]
    with torch.no_grad():
        tts = P.tts_embeds(hf.thinker.get_input_embeddings(), hf.talker.text_projection, ids)
        ours = P.build_talker_prompt(prompt, embed, hidden, speaker=ids.speaker_id("aiden"), tts=tts,
                                     ids=ids, **_projections(hf))
        trailing = P.trailing_text(embed[prompt.numel() + 1:], hf.talker.text_projection, tts)
    # user turns only: the system turn and the earlier assistant turn are left out
    assert ours.user_positions.tolist() == list(range(7, 15)) + list(range(22, 28))
    users = ours.user_positions.numel()
    assert torch.equal(ours.embeds[:users], talker["inputs_embeds"][0][:users])
    # The assistant prefix projects 4 rows (im_start, assistant, newline, first token: all that exists
    # when a streamed request's Talker starts); the reference projects them with every later generated
    # token in one [3 + T, H] multiply (the later tokens' rows are the trailing text). A CPU's GEMM may
    # round a row differently with the row count (one ulp on an AVX-512/AMX Xeon, equal on the EPYC
    # machines), so these rows get an ulp-level bound.
    torch.testing.assert_close(ours.embeds[users:], talker["inputs_embeds"][0][users:], rtol=0, atol=1e-8)
    assert torch.equal(ours.input_ids, talker["talker_input_ids"][0])
    torch.testing.assert_close(trailing, talker["trailing_text_hidden"][0], rtol=0, atol=1e-8)
    assert torch.equal(tts.pad, talker["tts_pad_embed"][0, 0])


def test_talker_user_part_projects_media_positions_from_the_hidden_states(hf):
    ids = P.OmniTokenIds.from_hf(hf.config)
    prompt = torch.tensor([IS, SYSTEM, NL, 100, IE, NL, IS, USER, NL, 151669, AUDIO, AUDIO, AUDIO, 151670,
                           151652, IMAGE, IMAGE, 151653, 9707, IE, NL, IS, ASSISTANT, NL])
    torch.manual_seed(4)
    embed, hidden = torch.randn(prompt.numel() + 1, HIDDEN), torch.randn(prompt.numel(), HIDDEN)
    mm = P.multimodal_mask(prompt, ids)
    with torch.no_grad():
        ref = hf._get_talker_user_parts(0, prompt.numel(), mm[None], hidden[None], embed[None, :-1])[0]
        tts = P.tts_embeds(hf.thinker.get_input_embeddings(), hf.talker.text_projection, ids)
        ours = P.build_talker_prompt(prompt, embed, hidden, speaker=ids.speaker_id("chelsie"), tts=tts,
                                     ids=ids, **_projections(hf))
    users = P.user_positions(prompt, ids)
    assert users.tolist() == list(range(6, 21))
    assert torch.equal(ours.embeds[:users.numel()], ref[users])
    assert ours.embeds.shape == (users.numel() + 9, HIDDEN)


def test_talker_prompt_errors():
    ids = P.OmniTokenIds()
    with pytest.raises(ValueError, match="choose one of: aiden, chelsie, ethan"):
        ids.speaker_id("bob")
    assert ids.speaker_id("Ethan") == 2302
    with pytest.raises(ValueError, match="assistant"):
        P.assistant_start([IS, USER, NL, 5, IE, NL], ids)
    with pytest.raises(ValueError, match="needs"):
        P.build_talker_prompt([IS, USER, NL, IE, NL, IS, ASSISTANT, NL], torch.zeros(8, 4), torch.zeros(8, 4),
                              speaker=1, tts=P.TtsEmbeds(*torch.zeros(3, 4)), text_projection=lambda x: x,
                              hidden_projection=lambda x: x, codec_embedding=lambda x: x, ids=ids)


def test_chat_token_ids_layout():
    ids = P.OmniTokenIds()
    turns = [P.ChatTurn("user", "ab", media=(P.AudioPart(2), P.ImagePart(1)))]
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    out = P.chat_token_ids(turns, encode, ids, system_prompt="S")
    assert out == [IS, SYSTEM, NL, ord("S"), IE, NL,
                   IS, USER, NL, ids.audio_start, AUDIO, AUDIO, ids.audio_end, ids.vision_start, IMAGE,
                   ids.vision_end, ord("a"), ord("b"), IE, NL, IS, ASSISTANT, NL]
    assert P.chat_token_ids([P.ChatTurn("system", "x")], encode, ids, system_prompt="S")[3] == ord("x")
    with pytest.raises(ValueError, match="unknown role"):
        P.chat_token_ids([P.ChatTurn("tool", "x")], encode, ids)


# ----------------------------------------------------------------------------------------- placements

PLACEMENTS = ["qwen3_omni_single.yaml", "qwen3_omni_two_gpu.yaml", "qwen3_omni_three_way.yaml"]
PLACEMENT_DIR = Path(__file__).resolve().parents[1] / "examples" / "placements"


@pytest.fixture(scope="module")
def one_rank_outputs():
    return _generate(None)


def _generate(placement):
    from mstar.models.qwen3_omni.model import Qwen3OmniTiny
    from mstar.runtime.api import Runtime

    prompts = [{"input_ids": torch.tensor([IS, USER, NL, 9707, 11, 1879, IE, NL, IS, ASSISTANT, NL])},
               {"input_ids": torch.tensor([IS, USER, NL, 77, 78, IE, NL, IS, ASSISTANT, NL])}]
    params = {"max_tokens": 5, "audio": True, "voice": "ethan", "talker_sampling": {"temperature": 0, "max_tokens": 30}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSTAR_KERNELS", "torch")
        with Runtime(Qwen3OmniTiny(), placement) as rt:
            outs = rt.generate(prompts, params)
    return [(torch.cat(o.tensors("text")), torch.cat(o.tensors("audio"))) for o in outs]


@pytest.mark.parametrize("name", PLACEMENTS)
def test_shipped_placements_validate(name):
    from mstar.models.qwen3_omni.graph import build_graph as build_omni_graph
    from mstar.placement import Placement

    placement = Placement.load(PLACEMENT_DIR / name).check_model("qwen3-omni")
    assert placement.validate(build_omni_graph()).num_ranks == PLACEMENTS.index(name) + 1


@pytest.mark.parametrize("name", PLACEMENTS[1:])
def test_every_placement_gives_the_same_text_and_audio(one_rank_outputs, name):
    for (text, audio), (ref_text, ref_audio) in zip(_generate(PLACEMENT_DIR / name), one_rank_outputs):
        assert torch.equal(text, ref_text)
        assert audio.shape == ref_audio.shape and audio.shape[0] > 1920 * 25  # more than one chunk
        assert torch.equal(audio, ref_audio)


# ------------------------------------------------------------------------------------------ encoders


def test_resample_is_band_limited_and_has_the_expected_length():
    from mstar.models.qwen3_omni.encoders import resample

    for rate in (24000, 44100, 8000):
        t = torch.arange(rate) / rate
        out = resample(torch.sin(2 * math.pi * 440 * t), rate, 16000)
        assert out.shape == (16000,)
        expected = torch.sin(2 * math.pi * 440 * torch.arange(16000) / 16000)
        assert (out - expected)[200:-200].abs().max() < 1e-3  # edges see the zero padding


def test_audio_tower_equals_transformers_on_a_batch_of_clips(hf, checkpoint):
    from mstar.models.qwen3_omni.encoders import AudioTower, audio_input

    tower = AudioTower(hf.config.thinker_config.audio_config)
    tower.load_weights(checkpoint)
    t = torch.arange(72000) / 24000
    pcm = (0.3 * torch.sin(2 * math.pi * 440 * t) * 32767).to(torch.int16)
    long, short = audio_input(pcm, 24000), audio_input(pcm[:24000], 24000)
    assert (long.features.shape, long.num_tokens, short.features.shape, short.num_tokens) == \
        ((128, 300), 39, (128, 100), 13)
    ours = tower([long.features, short.features])
    padded = torch.zeros(2, 128, 300)
    padded[0], padded[1, :, :100] = long.features, short.features
    mask = torch.zeros(2, 300, dtype=torch.long)
    mask[0], mask[1, :100] = 1, 1
    with torch.no_grad():
        ref = hf.thinker.model.get_audio_features(padded, feature_attention_mask=mask).last_hidden_state
    assert [o.shape[0] for o in ours] == [39, 13]
    torch.testing.assert_close(torch.cat(ours), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tower([short.features])[0], ours[1], rtol=1e-5, atol=1e-6)


def test_vision_tower_equals_transformers(hf, checkpoint):
    from mstar.models.qwen3_omni.encoders import VisionTower, image_input

    tower = VisionTower(hf.config.thinker_config.vision_config)
    tower.load_weights(checkpoint)
    gen = torch.Generator().manual_seed(5)
    images = [image_input(torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
              for shape in ((64, 96, 3), (40, 40, 3))]
    assert [(i.grid_thw.tolist(), i.num_tokens) for i in images] == [([1, 4, 6], 6), ([1, 4, 4], 4)]
    pixels, grid = torch.cat([i.pixel_values for i in images]), torch.stack([i.grid_thw for i in images])
    ours = tower(pixels, grid)
    with torch.no_grad():
        ref = hf.thinker.model.get_image_features(pixels, grid)
    torch.testing.assert_close(torch.cat(ours.embeds), torch.cat(ref.pooler_output), rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(ours.deepstack, ref.deepstack_features):
        torch.testing.assert_close(torch.cat(mine), torch.cat(theirs), rtol=1e-5, atol=1e-6)


def test_resize_mlp_rows_are_batch_invariant_where_it_says_so():
    """The Talker projects every request's text rows in one call only where ``row_invariant`` holds
    (the prepacked panel kernel): then each row is the same bits alone and among others."""
    from mstar.layers.prepack import prepack_mode
    from mstar.models.qwen3_omni.talker import ResizeMLP

    torch.manual_seed(0)
    mlp = ResizeMLP(32, 64, 48)
    x = torch.randn(37, 32)
    assert not mlp.row_invariant(x)  # the plain path: no promise
    if prepack_mode() != "panel":
        pytest.skip("the compiled panel kernel is not built here")
    assert mlp.linear_fc1.prepack() and mlp.linear_fc2.prepack()
    assert mlp.row_invariant(x) and not mlp.row_invariant(x.double())
    together = mlp(x)
    parts = torch.cat([mlp(x[:1]), mlp(x[1:5]), mlp(x[5:])])
    assert torch.equal(together, parts)
    torch.testing.assert_close(together, ResizeMLP.forward(_plain(mlp), x), rtol=1e-5, atol=1e-5)


def _plain(mlp):
    """A copy of ``mlp`` on the plain path."""
    from mstar.models.qwen3_omni.talker import ResizeMLP

    out = ResizeMLP(mlp.linear_fc1.in_features, mlp.linear_fc1.out_features, mlp.linear_fc2.out_features)
    out.load_state_dict(mlp.state_dict())
    return out
