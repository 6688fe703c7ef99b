"""Qwen3-Omni through the Runtime (in-process): a tiny random checkpoint saved by transformers, loaded by
mstar's loader, against ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` with the
same weights (fp32, greedy thinker and talker): text tokens, every frame's 16 codes, the waveform and
its exact length; text-only requests skip the Talker and Code2Wav; batched requests give what each
gives alone; KV blocks back to zero."""

from __future__ import annotations

import pytest
import torch

from mstar import RequestStatus
from mstar.model.submodule import EngineInputs, ForwardInfo
from mstar.models.qwen3_omni import graph as omni_graph
from mstar.models.qwen3_omni import loader
from mstar.models.qwen3_omni.config import TINY_HF_CONFIG
from mstar.models.qwen3_omni.model import Qwen3Omni, Qwen3OmniTiny
from mstar.runtime.api import Runtime
from tests.helpers import kv_blocks_in_use

transformers = pytest.importorskip("transformers")

IM_START, IM_END, SYSTEM, USER, ASSISTANT, NL = 151644, 151645, 8948, 872, 77091, 198


def chat(*user_text: int) -> torch.Tensor:
    """A system turn, one user turn with ``user_text``, and the assistant header."""
    return torch.tensor([IM_START, SYSTEM, NL, 100, 101, IM_END, NL, IM_START, USER, NL, *user_text, IM_END, NL,
                         IM_START, ASSISTANT, NL])


PROMPTS = [chat(9707, 11, 1879), chat(40, 1079, 264, 8967, 30), chat(15339)]
GREEDY_TALKER = {"temperature": 0.0}


@pytest.fixture(autouse=True)
def _torch_attention(monkeypatch):
    # the PyTorch paged-attention path: the compiled kernel is tested on its own, and loading it
    # would dominate these tests' time
    monkeypatch.setenv("MSTAR_KERNELS", "torch")


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(transformers model, checkpoint dir) of the tiny config, seeded, saved by transformers."""
    model = loader.hf_reference_model(TINY_HF_CONFIG, seed=0)
    path = tmp_path_factory.mktemp("qwen3_omni_tiny")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def runtime(omni):
    import os

    old = os.environ.get("MSTAR_KERNELS")
    os.environ["MSTAR_KERNELS"] = "torch"
    try:
        with Runtime(Qwen3Omni(omni[1])) as rt:
            yield rt
    finally:
        if old is None:
            os.environ.pop("MSTAR_KERNELS", None)
        else:
            os.environ["MSTAR_KERNELS"] = old


def hf_generate(model, ids, text_tokens, talker_steps, **talker):
    """transformers' text ids, frame codes [F, 16] and waveform, greedy."""
    captured = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, *args, **kw):
        captured["codes"] = codes[0].T.clone()
        return decode(codes, *args, **kw)

    model.code2wav.chunked_decode = capture
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            seq, wav = model.generate(input_ids=ids[None], speaker="Ethan", return_audio=True,
                                      thinker_max_new_tokens=text_tokens, thinker_do_sample=False,
                                      talker_max_new_tokens=talker_steps, talker_do_sample=False, **talker)
    finally:
        model.code2wav.chunked_decode = decode
    return seq[0, ids.numel():].tolist(), captured["codes"], wav.reshape(-1)


def ours(out):
    assert out.finished, out.error
    frames = [f for f in out.tensors("frame_codes") if f.numel()]
    audio = out.tensors("audio")
    return ([int(t) for t in out.tensors("text")], torch.stack(frames) if frames else torch.zeros(0, 16),
            torch.cat(audio) if audio else torch.zeros(0))


def audio_params(text_tokens, talker_steps, **talker):
    return {"audio": True, "max_tokens": text_tokens, "voice": "Ethan",
            "talker_sampling": {**GREEDY_TALKER, "max_tokens": talker_steps, **talker}}


@pytest.mark.parametrize("text_tokens,talker_steps", [(8, 40), (5, 3)], ids=["eos", "talker-max"])
def test_audio_matches_transformers_generate(omni, runtime, text_tokens, talker_steps):
    model, _ = omni
    ids = PROMPTS[0]
    ref_text, ref_codes, ref_wav = hf_generate(model, ids, text_tokens, talker_steps)
    text, codes, wav = ours(runtime.generate({"input_ids": ids}, audio_params(text_tokens, talker_steps))[0])
    assert text == ref_text
    assert torch.equal(codes, ref_codes)
    assert wav.numel() == ref_wav.numel() == 1920 * codes.shape[0] - 555
    assert ref_wav.abs().max() > 0  # the tiny model's waveform is quiet: compare relative error too
    assert (wav - ref_wav).abs().max() <= 1e-4 and (wav - ref_wav).norm() <= 1e-5 * ref_wav.norm()
    assert kv_blocks_in_use(runtime) == 0


def test_long_speech_streams_exact_length(omni, runtime):
    """60 frames (EOS suppressed on both sides): Code2Wav chunks of 5, 10, 20, 25 new frames, each with the
    model's exact left context (its pre-transformer's reach; here more than the stream so far):
    codes identical, the streamed waveform as long as a full decode and equal to it."""
    model, _ = omni
    ids = PROMPTS[1]
    vocab = model.config.talker_config.text_config.vocab_size
    no_eos = list(range(vocab - 1024, vocab))
    ref_text, ref_codes, ref_wav = hf_generate(model, ids, 6, 61, talker_suppress_tokens=no_eos)
    text, codes, wav = ours(runtime.generate({"input_ids": ids}, audio_params(6, 61, ignore_eos=True))[0])
    assert text == ref_text and codes.shape == (60, 16)
    assert torch.equal(codes, ref_codes)
    assert wav.numel() == ref_wav.numel() == 1920 * 60 - 555
    assert (wav - ref_wav).abs().max() <= 1e-4 and (wav - ref_wav).norm() <= 1e-5 * ref_wav.norm()
    # the request's end is reported as its FreeRequest is sent; a stats round trip through the workers
    # comes after that message, so the vocoder state must be gone by then
    runtime.stats()
    assert runtime.local_module("Code2Wav")._states == {}  # the vocoder state went with the request


def test_code2wav_chunks_without_their_state_decode_exactly(omni, runtime, monkeypatch):
    """A later chunk whose vocoder state is gone (a restarted rank) takes the stateless decode over
    its left context: the same waveform; with the state, each chunk convolves only its new frames."""
    model, _ = omni
    node = runtime.local_module("Code2Wav")
    ids = PROMPTS[1]
    params = audio_params(6, 61, ignore_eos=True)
    seen: dict[str, list] = {"next": [], "stateless": []}
    decode_next, decode_chunks = node.code2wav.decode_next_many, node.code2wav.decode_chunks
    monkeypatch.setattr(node.code2wav, "decode_next_many",
                        lambda chunks: seen["next"].extend(c.left_context for c in chunks) or decode_next(chunks))
    monkeypatch.setattr(node.code2wav, "decode_chunks",
                        lambda chunks: seen["stateless"].append(len(chunks)) or decode_chunks(chunks))
    _, _, with_state = ours(runtime.generate({"input_ids": ids}, params)[0])
    assert len(seen["next"]) >= 4 and not seen["stateless"]
    forward = node.forward

    def forgetful(*a, **kw):
        node._states.clear()
        return forward(*a, **kw)

    monkeypatch.setattr(node, "forward", forgetful)
    seen["next"].clear()
    _, _, without = ours(runtime.generate({"input_ids": ids}, params)[0])
    assert seen["next"] == [0] and len(seen["stateless"]) >= 3  # only the first chunk had no context
    assert without.numel() == with_state.numel() == 1920 * 60 - 555
    assert (without - with_state).abs().max() <= 1e-5


def test_text_only_skips_talker_and_code2wav(runtime):
    calls = {}
    for name in ("Talker", "code_predictor", "Code2Wav"):
        module = runtime.local_module(name)
        forward = module.forward

        def counted(*a, _name=name, _forward=forward, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _forward(*a, **kw)

        module.forward = counted
    try:
        out = runtime.generate({"input_ids": PROMPTS[0]}, {"max_tokens": 8})[0]
    finally:
        for name in ("Talker", "code_predictor", "Code2Wav"):
            del runtime.local_module(name).forward
    assert out.finished, out.error
    spoken = runtime.generate({"input_ids": PROMPTS[0]}, audio_params(8, 40))[0]
    assert [int(t) for t in out.tensors("text")] == [int(t) for t in spoken.tensors("text")]
    assert calls == {} and not out.tensors("audio")
    assert kv_blocks_in_use(runtime) == 0


def test_thinker_repetition_penalty_matches_transformers(omni, runtime):
    """A penalty below 1 favours seen tokens (the random tiny model never repeats on its own)."""
    model, _ = omni
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = model.thinker.generate(input_ids=ids[None], max_new_tokens=12, do_sample=False, eos_token_id=IM_END,
                                     repetition_penalty=0.05)
    out = runtime.generate({"input_ids": ids}, {"max_tokens": 12, "sampling": {"repetition_penalty": 0.05}})[0]
    plain = runtime.generate({"input_ids": ids}, {"max_tokens": 12})[0]
    assert [int(t) for t in out.tensors("text")] == ref[0, ids.numel():].tolist()
    assert [int(t) for t in out.tensors("text")] != [int(t) for t in plain.tensors("text")]


def test_batched_requests_match_each_alone(runtime):
    params = [audio_params(n, 30) for n in (8, 6, 4)]
    alone = [ours(runtime.generate({"input_ids": p}, q)[0]) for p, q in zip(PROMPTS, params)]
    together = runtime.generate([{"input_ids": p} for p in PROMPTS], params)
    for (text, codes, wav), out in zip(alone, together):
        t2, c2, w2 = ours(out)
        assert t2 == text and torch.equal(c2, codes)
        assert torch.equal(w2, wav)  # audio depends on the codes alone: Code2Wav decodes each chunk alone
    assert kv_blocks_in_use(runtime) == 0


@pytest.mark.parametrize("params,match", [
    ({"audio": True, "voice": "nobody"}, "unknown voice"),
    ({"audio": True, "talker_sampling": {"top_p": 2.0}}, "top_p"),
    ({"sampling": {"repetition_penalty": -1.0}}, "repetition_penalty"),
    ({"max_tokens": 5000}, "exceeds"),
])
def test_bad_requests_are_rejected(runtime, params, match):
    with pytest.raises(ValueError, match=match):
        runtime.submit({"input_ids": PROMPTS[0]}, params)


def test_audio_needs_an_assistant_turn_at_the_end(runtime):
    with pytest.raises(ValueError, match="assistant"):
        runtime.submit({"input_ids": PROMPTS[0][:-3]}, {"audio": True})
    with pytest.raises(ValueError, match="go together"):
        runtime.submit({"input_ids": PROMPTS[0], "pixel_values": torch.zeros(4, 8)}, {})
    with pytest.raises(ValueError, match="image placeholders and no images"):
        runtime.submit({"input_ids": chat(151652, 151655, 151653)}, {})


def test_code_predictor_running_rows_give_the_general_paths_speech(runtime):
    """The code predictor's steps of a batch go on as running rows (``StatelessRowsEngine``, the
    loop's codes and sum handed to its exits as they come): with the talker and predictor sampled
    (seeded) and requests of different lengths, every output equals the general path's, where each
    step is prepared and finished by the tracker."""
    from mstar.runtime.stateless_rows import StatelessRowsEngine

    params = [{"audio": True, "max_tokens": n, "voice": "Ethan", "talker_sampling": {"seed": 3 + n, "max_tokens": m, "ignore_eos": True}}
              for n, m in ((8, 30), (6, 12), (4, 21))]
    engine = runtime.local_engine("code_predictor")
    before = engine.row_forwards
    rows = [ours(out) for out in runtime.generate([{"input_ids": p} for p in PROMPTS], params)]
    assert engine.row_forwards > before
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StatelessRowsEngine, "continues_batches", False)
        before = engine.row_forwards
        general = [ours(out) for out in runtime.generate([{"input_ids": p} for p in PROMPTS], params)]
        assert engine.row_forwards == before
    for (text, codes, wav), (t2, c2, w2) in zip(rows, general):
        assert text == t2 and torch.equal(codes, c2) and torch.equal(wav, w2) and codes.shape[0] >= 11
    # arrivals apart: the first request's frames are under way when the others come (its frames run
    # alone, then with theirs: other batches, other running rows), the same outputs
    first = runtime.submit({"input_ids": PROMPTS[0]}, params[0])
    for item in first:
        if item.name == "frame_codes":
            break
    rest = [runtime.submit({"input_ids": p}, q) for p, q in zip(PROMPTS[1:], params[1:])]
    for (text, codes, wav), out in zip(general, [first.result(timeout=120)] + [h.result(timeout=120) for h in rest]):
        t2, c2, w2 = ours(out)
        assert text == t2 and torch.equal(codes, c2) and torch.equal(wav, w2)
    assert kv_blocks_in_use(runtime) == 0 and runtime.stats()["ranks"][0]["walks"] == 0
    assert runtime.local_worker("Talker").walks.partitions == 0  # the walks' index by partition forgot them too


def test_thinker_running_rows_stream_as_the_general_path(runtime):
    """The Thinker's decode steps, which stream every position's states to the Talker, go on
    as running rows (the worker pushes each row's items; those pushes reach the Talker's partition without
    ending the running rows): with a seeded sampled Thinker and answers of different lengths, every output
    equals the general path's, where each step is prepared and finished by the tracker."""
    from mstar.runtime.kv.engine import KVCacheEngine

    params = [{**audio_params(n, 14), "sampling": {"temperature": 0.9, "seed": 5 + n, "ignore_eos": True}}
              for n in (12, 9, 6)]
    params[1]["sampling"] = {"temperature": 0.0, "ignore_eos": True}
    engine = runtime.local_engine("Thinker")
    before = engine.row_forwards
    rows = [ours(out) for out in runtime.generate([{"input_ids": p} for p in PROMPTS], params)]
    assert engine.row_forwards - before >= 8  # of the longest answer's 11 decode steps
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCacheEngine, "continues_batches", False)
        before = engine.row_forwards
        general = [ours(out) for out in runtime.generate([{"input_ids": p} for p in PROMPTS], params)]
        assert engine.row_forwards == before
    for (text, codes, wav), (t2, c2, w2), q in zip(rows, general, params):
        assert text == t2 and len(text) == q["max_tokens"]
        assert torch.equal(codes, c2) and torch.equal(wav, w2) and codes.shape[0] == 13


def test_tiny_model_samples_speech_reproducibly():
    """qwen3-omni-tiny with the reference's sampling defaults (talker and code predictor sampled),
    seeded: two runs give the same audio, whose length follows its frame count."""
    params = {"audio": True, "max_tokens": 6, "talker_sampling": {"seed": 7, "max_tokens": 30}}
    with Runtime(Qwen3OmniTiny()) as rt:
        first, again = (ours(rt.generate({"input_ids": PROMPTS[2]}, params)[0]) for _ in range(2))
        assert kv_blocks_in_use(rt) == 0
    text, codes, wav = first
    assert len(text) == 6 and 1 <= codes.shape[0] <= 29
    assert wav.numel() == 1920 * codes.shape[0] - 555
    assert text == again[0] and torch.equal(codes, again[1]) and torch.equal(wav, again[2])


PLACEMENTS = ["qwen3_omni_two_gpu.yaml", "qwen3_omni_three_way.yaml"]


@pytest.mark.parametrize("name", PLACEMENTS)
def test_placements_give_the_same_outputs(omni, runtime, name):
    """Thinker apart from Talker + Code2Wav (the paper's 2-GPU layout), and all three apart: KV stays
    with its module's rank, streams cross ranks, outputs are those of one rank."""
    from pathlib import Path

    from mstar.placement import Placement

    params = audio_params(8, 40)
    expected = ours(runtime.generate({"input_ids": PROMPTS[0]}, params)[0])
    placement = Placement.load(Path(__file__).parents[1] / "examples" / "placements" / name)
    with Runtime(Qwen3Omni(omni[1]), placement) as rt:
        got = ours(rt.generate({"input_ids": PROMPTS[0]}, params)[0])
        assert kv_blocks_in_use(rt) == 0
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


@pytest.mark.slow
def test_worker_processes_give_the_same_outputs(omni, runtime):
    """The 2-GPU layout with one worker process per rank: every value crossing a process (stream
    items, the per-frame predictor state, emitted audio) goes through the wire format."""
    from pathlib import Path

    from mstar.placement import Placement

    params = audio_params(8, 40)
    expected = ours(runtime.generate({"input_ids": PROMPTS[1]}, params)[0])
    placement = Placement.load(Path(__file__).parents[1] / "examples" / "placements" / PLACEMENTS[0])
    with Runtime(Qwen3Omni(omni[1]), placement, workers="process") as rt:
        got = ours(rt.generate({"input_ids": PROMPTS[1]}, params)[0])
        assert kv_blocks_in_use(rt) == 0
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


AUDIO_START, AUDIO, AUDIO_END = 151669, 151675, 151670


def test_audio_input_matches_transformers_generate(omni, runtime):
    """A spoken question (1.3 s of a tone, as log-mel features): the audio tower's rows replace the
    placeholders; text, codes and waveform as transformers' with ``input_features``."""
    from mstar.models.qwen3_omni.encoders import audio_input

    model, _ = omni
    t = torch.arange(20800) / 16000
    clip = audio_input((0.3 * torch.sin(2 * torch.pi * 440 * t)).float(), 16000)
    ids = chat(AUDIO_START, *[AUDIO] * clip.num_tokens, AUDIO_END, 9707, 11)
    ref_text, ref_codes, ref_wav = hf_generate(model, ids, 6, 30, input_features=clip.features[None],
                                               feature_attention_mask=torch.ones(1, clip.features.shape[1],
                                                                                 dtype=torch.long))
    out = runtime.generate({"input_ids": ids, "audio_features": [clip.features]}, audio_params(6, 30))[0]
    text, codes, wav = ours(out)
    assert text == ref_text and torch.equal(codes, ref_codes)
    assert wav.numel() == ref_wav.numel() and (wav - ref_wav).norm() <= 1e-5 * ref_wav.norm()
    text_only = runtime.generate({"input_ids": ids, "audio_features": [clip.features]}, {"max_tokens": 6})[0]
    assert [int(x) for x in text_only.tensors("text")] == ref_text
    with pytest.raises(ValueError, match="placeholders"):
        short = chat(AUDIO_START, *[AUDIO] * (clip.num_tokens - 1), AUDIO_END, 9707, 11)
        runtime.submit({"input_ids": short, "audio_features": [clip.features]}, {})
    assert kv_blocks_in_use(runtime) == 0


VISION_START, IMAGE, VISION_END = 151652, 151655, 151653


def test_image_input_matches_transformers_generate(omni, runtime):
    """An image (64 x 96): the vision tower's rows replace the placeholders, its deepstack features
    join the first layers, and the 3-D M-RoPE positions (thinker and talker) follow the reference."""
    from mstar.models.qwen3_omni.encoders import image_input

    model, _ = omni
    torch.manual_seed(5)
    image = image_input(torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8))
    ids = chat(VISION_START, *[IMAGE] * image.num_tokens, VISION_END, 9707, 11)
    grids = image.grid_thw[None]
    ref_text, ref_codes, ref_wav = hf_generate(model, ids, 6, 30, pixel_values=image.pixel_values,
                                               image_grid_thw=grids)
    inputs = {"input_ids": ids, "pixel_values": image.pixel_values, "image_grid_thw": grids}
    text, codes, wav = ours(runtime.generate(inputs, audio_params(6, 30))[0])
    assert text == ref_text and torch.equal(codes, ref_codes)
    assert wav.numel() == ref_wav.numel() and (wav - ref_wav).norm() <= 1e-5 * ref_wav.norm()
    with pytest.raises(ValueError, match="placeholders"):
        runtime.submit({**inputs, "input_ids": chat(VISION_START, IMAGE, VISION_END)}, {})
    assert kv_blocks_in_use(runtime) == 0


def test_image_preprocessing_from_the_checkpoint_through_the_chat_path(omni, tmp_path):
    """A checkpoint whose ``preprocessor_config.json`` differs from the image processor's defaults (the
    released mean = std = 0.5, a smaller pixel budget): an ``image_url`` chat message becomes
    transformers' pixel values and grid (its processor loaded from the same directory), and the
    answer's text, codes and waveform are transformers' ``generate`` on them."""
    import json

    from mstar.models.llama.tokenizer import ByteTokenizer
    from mstar.models.qwen3_omni.adapter import Qwen3OmniAdapter

    model, path = omni
    ckpt = tmp_path / "with_preprocessor"
    ckpt.mkdir()
    for f in path.iterdir():
        (ckpt / f.name).symlink_to(f)
    (ckpt / "preprocessor_config.json").write_text(json.dumps({
        "processor_class": "Qwen3OmniMoeProcessor", "image_processor_type": "Qwen2VLImageProcessor",
        "feature_extractor_type": "WhisperFeatureExtractor", "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "min_pixels": 3136, "max_pixels": 100_000, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "feature_size": 128, "sampling_rate": 16000,
        "hop_length": 160, "n_fft": 400, "chunk_length": 300}))
    pixels = torch.randint(0, 256, (480, 640, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    ref = transformers.AutoImageProcessor.from_pretrained(ckpt)(images=[pixels.numpy()], return_tensors="pt")
    served = Qwen3Omni(ckpt)
    served._tokenizer = ByteTokenizer()  # the saved checkpoint has no tokenizer.json; ids are compared, not text
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}},
                                                      {"type": "text", "text": "What is it?"}]}]}
    request = Qwen3OmniAdapter(served).chat_request(body, [pixels], [])
    got_pixels, got_grid = request.inputs["pixel_values"][0], request.inputs["image_grid_thw"][0]
    assert got_grid.tolist() == ref["image_grid_thw"].tolist() == [[1, 16, 22]]  # the default budget: [1, 30, 40]
    assert torch.equal(got_pixels, ref["pixel_values"].float())
    ids = request.inputs["input_ids"][0]
    assert int((ids == IMAGE).sum()) == 16 * 22 // 4
    ref_text, ref_codes, ref_wav = hf_generate(model, ids, 6, 30, pixel_values=ref["pixel_values"].float(),
                                               image_grid_thw=ref["image_grid_thw"])
    with Runtime(served) as rt:
        text, codes, wav = ours(rt.generate(request.inputs, audio_params(6, 30))[0])
        assert kv_blocks_in_use(rt) == 0
    assert text == ref_text and torch.equal(codes, ref_codes)
    assert wav.numel() == ref_wav.numel() and (wav - ref_wav).norm() <= 1e-5 * ref_wav.norm()


def test_abort_mid_speech_frees_everything(runtime):
    """A client leaving after the first audio chunk: the request ends ABORTED, while the Talker is
    still speaking, and its KV blocks (both caches) and walks are gone."""
    handle = runtime.submit({"input_ids": PROMPTS[0]}, audio_params(8, 200, ignore_eos=True))
    first_audio = next(ev for ev in handle if ev.name == "audio")
    runtime.abort(handle.request_id)
    assert first_audio.value[0].numel() == 1920 * omni_graph.CODE2WAV_FIRST_CHUNK - 555
    assert handle.result(timeout=60).status is RequestStatus.ABORTED
    stats = runtime.stats()
    assert kv_blocks_in_use(runtime) == 0 and stats["running_requests"] == 0
    assert all(rank["walks"] == 0 for rank in stats["ranks"])


def test_one_token_answer_still_speaks(runtime):
    """The thinker stops at its first token (max_tokens 1: no decode walk). transformers refuses this
    (its talker prompt needs a second token); here the talker reads tts_eos as the answer's text."""
    out = runtime.generate({"input_ids": PROMPTS[0]}, audio_params(1, 6))[0]
    text, codes, wav = ours(out)
    assert len(text) == 1 and 1 <= codes.shape[0] <= 5 and wav.numel() == 1920 * codes.shape[0] - 555
    assert kv_blocks_in_use(runtime) == 0


def _speech(voice: str = "ethan"):
    """A parsed speech request (the Talker's prefill reads its voice)."""
    from mstar.layers.sampling import SamplingParams
    from mstar.models.qwen3_omni.request import OmniRequest

    return OmniRequest(SamplingParams(), (), audio=True, voice=voice, talker=SamplingParams(),
                       predictor=SamplingParams())


def test_text_prompts_take_the_talker_prefill_fast_path_with_the_same_rows(omni):
    """A prompt without media placeholders builds its Talker prefill from the ids as a list; every
    field equals the general path's (user rows of every user turn, header rows, positions, prefix
    key), for a system + user prompt, several turns, no system turn, tokens before any
    ``<|im_start|>``, an empty user turn and another voice; prompts the fast path does not take
    (media, no assistant header at the end) still reach the general path and its errors."""
    talker = Qwen3Omni(omni[1]).build_submodules(["Talker"])["Talker"]
    body = [IM_START, USER, NL, 40, 41, IM_END, NL]
    prompts = [chat(9707, 11, 1879), torch.tensor([*body, IM_START, ASSISTANT, NL, 50, IM_END, NL, *body, IM_START, ASSISTANT, NL]),
               torch.tensor([*body, IM_START, ASSISTANT, NL]), torch.tensor([7, 8, *body, IM_START, ASSISTANT, NL]),
               torch.tensor([IM_START, USER, NL, IM_END, NL, IM_START, ASSISTANT, NL])]
    for prompt in prompts:
        for params in (_speech(), _speech("chelsie")):
            states = torch.randn(prompt.numel(), 2, 64)
            fast = talker._prefill_request(prompt, [states], None, params)
            assert talker._text_prefill_request(prompt.tolist(), states, params) is not None
            talker._text_prefill_request = lambda *_: None  # the general path (an instance attribute)
            slow = talker._prefill_request(prompt, [states], None, params)
            del talker._text_prefill_request
            (a, ka), (b, kb) = fast, slow
            assert torch.equal(ka, kb) and a.speaker == b.speaker and a.delta == b.delta
            for name in ("text_rows", "hidden_rows", "is_media", "positions"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError, match="must end with"):
        talker._prefill_request(prompts[0][:-1], [torch.randn(prompts[0].numel() - 1, 2, 64)], None, _speech())
    with_audio = chat(151675, 9707)
    assert talker._text_prefill_request(with_audio.tolist(), torch.randn(with_audio.numel(), 2, 64), _speech()) is None


def _prefix_hits(rt, node: str) -> int:
    return sum(r["kv"][node]["prefix_hit_tokens"] for r in rt.stats()["ranks"] if node in r["kv"])


def test_thinker_and_talker_reuse_shared_prompt_prefixes(omni):
    """Prompts starting alike (the system turn) reuse the Thinker's cached KV blocks of those tokens;
    the Talker still gets every prompt position's input embedding. The Talker's prompt rows (user
    turn, assistant rows with the speaker) are reused the same way when they repeat. Blocks stop
    before a prompt's first media placeholder: the same ids with another image must not reuse the
    first image's KV; another voice must not reuse the block holding the speaker's row. Outputs equal
    those of a runtime without prefix caching."""
    import dataclasses
    from pathlib import Path

    from mstar.models.qwen3_omni.encoders import image_input
    from mstar.placement import Placement

    base = Placement.load(Path(__file__).parents[1] / "examples" / "placements" / "qwen3_omni_single.yaml")
    placement = dataclasses.replace(base, limits=dataclasses.replace(base.limits, kv_block_size=4))
    images = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        images.append(image_input(torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8)))
    ids = chat(VISION_START, *[IMAGE] * images[0].num_tokens, VISION_END, 9707, 11)
    work = [({"input_ids": p}, audio_params(6, 12)) for p in PROMPTS] + [({"input_ids": PROMPTS[0]}, {"max_tokens": 6})]
    work += [({"input_ids": ids, "pixel_values": im.pixel_values, "image_grid_thw": im.grid_thw[None]},
              audio_params(6, 12)) for im in images]
    # 9 user rows + 8 assistant rows: the speaker's row (the 16th) lies in the last reusable block
    spoken = chat(2, 3, 5, 7)
    work += [({"input_ids": spoken}, {**audio_params(6, 12), "voice": voice}) for voice in ("Ethan", "Ethan", "Chelsie")]
    outputs = []
    for caching in (False, True):
        with Runtime(Qwen3Omni(omni[1]), placement, prefix_caching=caching) as rt:
            outputs.append([ours(rt.generate(inputs, params)[0]) for inputs, params in work])
            hits = _prefix_hits(rt, "Thinker"), _prefix_hits(rt, "Talker")
            assert kv_blocks_in_use(rt) == 0
        # Thinker: each prompt after the first reuses the 2 blocks of its 10-token system turn + user
        # header (the image prompts' third block holds a placeholder); a repeated prompt all its full
        # blocks but the last token's (PROMPTS[0] 4 of 5, ``spoken`` 4 of 4 for either voice).
        # Talker: the image prompts share 1 block before the placeholder; ``spoken`` again with Ethan
        # its 4 full blocks, with Chelsie 3 (the 4th holds the speaker)
        assert hits == ((8 * 5 + 16 + 16 + 16, 4 + 16 + 12) if caching else (0, 0))
    for (text, codes, wav), (t2, c2, w2) in zip(*outputs):
        assert t2 == text and torch.equal(c2, codes) and torch.equal(w2, wav)
    assert outputs[1][-4][0] != outputs[1][-5][0] or not torch.equal(outputs[1][-4][1], outputs[1][-5][1])
    assert not torch.equal(outputs[1][-1][1], outputs[1][-2][1])  # the voice changes the codes


def test_a_voice_chat_reuses_its_earlier_audio_turns(omni):
    """A text answer's prompt that starts with an earlier prompt holding a spoken turn reuses the
    Thinker's KV blocks through the audio placeholders (keyed by the clip's embeddings); another clip
    at the same placeholders shares nothing past them. A spoken answer's Talker reads the Thinker's
    states at the placeholders, so it reuses a clip only once they are kept: after a text answer it
    stops at the first placeholder; a text answer with ``keep_states`` (the realtime prefill) keeps
    them, and the spoken answer then reuses the blocks through the clip. Outputs (text, codes,
    waveform) equal those without prefix caching."""
    import dataclasses
    from pathlib import Path

    from mstar.models.qwen3_omni.encoders import audio_input
    from mstar.placement import Placement

    base = Placement.load(Path(__file__).parents[1] / "examples" / "placements" / "qwen3_omni_single.yaml")
    placement = dataclasses.replace(base, limits=dataclasses.replace(base.limits, kv_block_size=4))
    t = torch.arange(20800) / 16000
    clips = [audio_input((0.3 * torch.sin(2 * torch.pi * f * t)).float(), 16000) for f in (440, 660)]
    first = chat(AUDIO_START, *[AUDIO] * clips[0].num_tokens, AUDIO_END, 9707, 11)
    later = torch.cat([first, torch.tensor([9707, IM_END, NL, IM_START, USER, NL, 40, 1079, IM_END, NL,
                                            IM_START, ASSISTANT, NL])])  # its answer, then a text turn
    audio_rows = (first == AUDIO).nonzero().reshape(-1)
    work = [({"input_ids": first, "audio_features": [clips[0].features]}, {"max_tokens": 4}),
            ({"input_ids": later, "audio_features": [clips[0].features]}, {"max_tokens": 4}),
            ({"input_ids": later, "audio_features": [clips[1].features]}, {"max_tokens": 4}),
            ({"input_ids": later, "audio_features": [clips[0].features]}, audio_params(4, 6)),
            ({"input_ids": later, "audio_features": [clips[1].features]}, {"max_tokens": 1, "keep_states": True}),
            ({"input_ids": later, "audio_features": [clips[1].features]}, audio_params(4, 6))]
    outputs, hits = [], []
    for caching in (False, True):
        with Runtime(Qwen3Omni(omni[1]), placement, prefix_caching=caching) as rt:
            per = []
            for inputs, params in work:
                before = _prefix_hits(rt, "Thinker")
                outputs.append(ours(rt.generate(inputs, params)[0]))
                per.append(_prefix_hits(rt, "Thinker") - before)
            hits.append(per)
            assert kv_blocks_in_use(rt) == 0
    assert hits[0] == [0] * len(work)
    block = 4
    assert hits[1][1] == first.numel() // block * block > int(audio_rows[-1])  # through the spoken turn
    assert hits[1][2] <= int(audio_rows[0])  # another clip: only the blocks before its placeholders
    assert hits[1][3] <= int(audio_rows[0])  # a spoken answer: nothing from the first placeholder on
    assert hits[1][4] <= int(audio_rows[0])  # keep_states: the clip's states are not kept yet
    assert hits[1][5] == (later.numel() - 1) // block * block > int(audio_rows[-1])  # now kept: through the clip
    for cached, uncached in zip(outputs[len(work):], outputs[:len(work)]):
        assert cached[0] == uncached[0] and torch.equal(cached[1], uncached[1]) and torch.equal(cached[2], uncached[2])


def test_a_vad_request_walks_only_the_vad_node(runtime):
    """A ``VadRequest`` (inputs ``vad_audio``, ``vad_state``, ``vad_context``) walks the VAD node alone:
    its outputs are the node's for the stretch, two requests batched or not, and no KV is held."""
    from mstar.layers.vad import VAD_RATE, SileroVadNode, initial_vad_state, vad_available

    if not vad_available():
        pytest.skip("the silero-vad package is not installed")
    t = torch.arange(6 * 256) / VAD_RATE
    audio = [(0.3 * torch.sin(2 * torch.pi * f * t) * (1 + torch.sin(2 * torch.pi * 3 * t))).float()
             for f in (180.0, 300.0)]
    requests = [{"vad_audio": a, "vad_state": initial_vad_state()[0], "vad_context": initial_vad_state()[1]}
                for a in audio]
    outs = runtime.generate(requests, {})
    node = SileroVadNode()
    for inputs, out in zip(requests, outs):
        assert out.finished, out.error
        assert set(out.outputs) == {"vad_probs", "vad_state", "vad_context"}  # nothing of the Thinker's
        info = ForwardInfo("r", "vad", "vad", (), None)
        args = node.prepare_inputs("vad", info, {k: [v] for k, v in inputs.items()}).args
        alone = node.forward("vad", EngineInputs(["vad"], ["vad"], ["r"], [info], {}, [args]))
        for name in ("vad_probs", "vad_state", "vad_context"):
            torch.testing.assert_close(out.tensors(name)[0], alone[name][0], atol=1e-5, rtol=0)
    assert kv_blocks_in_use(runtime) == 0
    with pytest.raises(ValueError, match="VAD request"):
        runtime.submit({**requests[0], "input_ids": PROMPTS[0]}, {})
    with pytest.raises(ValueError, match="whole windows"):  # refused at submit, not in the node
        runtime.submit({**requests[0], "vad_audio": torch.zeros(100)}, {})
