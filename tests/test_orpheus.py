"""Orpheus TTS end to end: HF-checkpoint parity of the speech LM through the runtime (batched, and
on the prefill/decode split), streamed audio equal to the offline sliding-window decode, the
OpenAI speech route returning valid WAV, and the shipped placements."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import openai
import pytest
import torch

from mstar import Runtime
from mstar.model import resolve_model
from mstar.models.orpheus.codec import AUDIO_TOKEN_BASE, TOKENS_PER_FRAME, to_pcm16, tokens_to_codes
from mstar.models.orpheus.config import END_OF_PROMPT, START_OF_HUMAN, STOP_TOKEN, VOCAB_SIZE
from mstar.models.orpheus.loader import TINY_SNAC_CONFIG, dummy_snac
from mstar.models.orpheus.model import OrpheusTTS
from mstar.placement import Placement
from tests.helpers import kv_blocks_in_use
from tests.server_utils import running_server

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[START_OF_HUMAN, 5, 9, 13, *END_OF_PROMPT], [START_OF_HUMAN, 7, *END_OF_PROMPT],
           [START_OF_HUMAN, 11, 12, 13, 14, 15, 16, *END_OF_PROMPT]]
GREEDY = {"max_tokens": 40, "sampling": {"temperature": 0.0, "repetition_penalty": 1.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def orpheus_ckpt(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=128000, eos_token_id=STOP_TOKEN,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(2.0 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("orpheus")
    model.save_pretrained(path)
    snac_dir = path / "snac"
    snac_dir.mkdir()
    codec = dummy_snac(1)
    (snac_dir / "config.json").write_text(json.dumps(TINY_SNAC_CONFIG))
    torch.save(codec.state_dict(), snac_dir / "pytorch_model.bin")
    return model, path


def hf_tokens(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


PD = {"model": "orpheus", "node_groups": [
    {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
    {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]},
    {"node_names": ["snac_decoder"], "ranks": [1]}]}


@pytest.mark.parametrize("placement", [None, PD], ids=["one-rank", "prefill-decode-split"])
def test_speech_lm_matches_hf_generate(orpheus_ckpt, placement):
    hf, path = orpheus_ckpt
    expected = [hf_tokens(hf, p, 40) for p in PROMPTS]
    with Runtime(OrpheusTTS(model_path=path), Placement.from_dict(placement) if placement else None) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], GREEDY)
        for o, exp in zip(outs, expected):
            assert o.finished, o.error
            assert [int(t) for t in o.tensors("token")] == exp
        assert kv_blocks_in_use(rt) == 0


def offline_reference(snac_model, audio_tokens: list[int]) -> torch.Tensor:
    """Orpheus' reference streaming, written out: all tokens first, then for every count k = 28,
    35, ... decode the last 28 tokens and keep the second frame's samples."""
    pieces = []
    s = None
    for k in range(28, len(audio_tokens) + 1, 7):
        codes, valid = tokens_to_codes(audio_tokens[k - 28:k], k - 28)
        assert valid
        with torch.inference_mode():
            audio = snac_model.decode(codes)[0, 0]
        s = audio.shape[-1] // 4
        pieces.append(to_pcm16(audio[s:2 * s]))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int16)


def test_streamed_audio_equals_offline_sliding_window_decode():
    model = resolve_model("orpheus-tiny")
    params = {"max_tokens": 120, "sampling": {"seed": 3}}
    with Runtime(model) as rt:
        outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], params)
        snac_model = rt.local_module("snac_decoder").snac
        # the LM's decode steps, which stream every audio token, ran as running rows (running_rows.py)
        assert rt.stats()["ranks"][0]["kv"]["LLM"]["row_forwards"] >= 60
    for o in outs:
        assert o.finished, o.error
        toks = [int(t) for t in o.tensors("token")]
        audio_tokens = [t for t in toks if t >= AUDIO_TOKEN_BASE]
        assert len(audio_tokens) >= 56  # constrained decoding: (almost) every token is audio
        streamed = torch.cat(o.tensors("audio"))
        ref = offline_reference(snac_model, audio_tokens)
        assert streamed.shape == ref.shape and streamed.numel() > 0
        # windows of one request may batch into one SNAC call: at most one LSB apart (float noise)
        assert int((streamed.int() - ref.int()).abs().max()) <= 1
        assert float((streamed == ref).float().mean()) > 0.99


def test_candidate_logits_and_a_masked_full_head_draw_the_same_tokens():
    """The benchmark's ``head="full"`` (every logit computed, the non-candidates masked, as a logits
    processor of another engine does) samples exactly what the candidate-only head samples."""

    from mstar.layers.prepack import prepack_mode, prepack_requested
    from mstar.models.orpheus.model import OrpheusTiny

    params = {"max_tokens": 49, "sampling": {"seed": 5, "ignore_eos": True}}  # Orpheus's sampling defaults
    packs = prepack_requested() and prepack_mode(True) is not None
    got = {}
    for cand in (True, False):
        with Runtime(OrpheusTiny(candidate_logits=cand)) as rt:
            llm = rt.local_module("LLM")
            assert llm.candidate_logits is cand
            # the whole head's logits come from the prepacked head; the candidates from the plain weight
            assert (llm.prepacked is not None) is (packs and not cand)
            outs = rt.generate([{"input_ids": torch.tensor(p)} for p in PROMPTS], params)
        assert all(o.finished for o in outs)
        got[cand] = [[int(t) for t in o.tensors("token")] for o in outs]
    assert got[True] == got[False]
    assert all(len(t) == 49 and all(x >= AUDIO_TOKEN_BASE or x == STOP_TOKEN for x in t) for t in got[True])


def test_speech_route_returns_valid_wav_streamed_and_not():
    with running_server(resolve_model("orpheus-tiny"), "orpheus-tiny") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        extra = {"max_tokens": 70, "seed": 1}
        speech = client.audio.speech.create(model="orpheus-tiny", input="Hello <laugh> world", voice="tara",
                                            response_format="wav", extra_body=extra)
        with wave.open(io.BytesIO(speech.read())) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            n = w.getnframes()
            assert n > 0
        with client.audio.speech.with_streaming_response.create(
                model="orpheus-tiny", input="Hello <laugh> world", voice="tara", response_format="wav",
                extra_body={**extra, "stream_format": "audio"}) as resp:
            data = resp.read()
        assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
        assert len(data) - 44 == 2 * n  # same seed, same audio, streamed with an open-ended header
        voices = client.get("/audio/voices", cast_to=object)
        assert "tara" in voices["voices"]
        with pytest.raises(openai.BadRequestError, match="unknown voice"):
            client.audio.speech.create(model="orpheus-tiny", input="x", voice="nobody")
        # over the Realtime API: the user's text spoken, the same greedy audio as /v1/audio/speech's pcm
        greedy = {"max_tokens": 70, "temperature": 0.0}
        pcm = client.audio.speech.create(model="orpheus-tiny", input="Hello <laugh> world", voice="leo",
                                         response_format="pcm", extra_body=greedy).read()
        with client.realtime.connect(model="orpheus-tiny") as conn:
            assert conn.recv().session.output_modalities == ["audio"]
            conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "leo"}},
                                         "temperature": 0.0, "max_output_tokens": 70})
            assert conn.recv().type == "session.updated"
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": "Hello <laugh> world"}]})
            conn.response.create()
            chunks = []
            for event in conn:
                if event.type == "response.output_audio.delta":
                    chunks.append(base64.b64decode(event.delta))
                elif event.type == "response.done":
                    break
        assert len(chunks) > 1 and b"".join(chunks) == pcm


def test_real_layout_needs_snac_directory(orpheus_ckpt, tmp_path):
    _, path = orpheus_ckpt
    bare = tmp_path / "llm_only"
    bare.mkdir()
    for f in path.iterdir():
        if f.is_file():
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="SNAC codec directory"):
        OrpheusTTS(model_path=bare)


@pytest.mark.parametrize("name", ["orpheus_single.yaml", "orpheus_pd_split.yaml", "orpheus_codec_rank.yaml"])
def test_shipped_placements_validate(name):
    from mstar.models.orpheus.graph import build_graph as build_orpheus_graph

    p = Placement.load(ROOT / "examples" / "placements" / name).check_model("orpheus")
    assert p.validate(build_orpheus_graph()).num_ranks in (1, 2)


def test_audio_token_encoding_matches_reference_formula():
    codes = [0, 4095, 17, 4000, 1, 2, 3]
    tokens = [AUDIO_TOKEN_BASE + c + i * 4096 for i, c in enumerate(codes)]
    (l0, l1, l2), valid = tokens_to_codes(tokens, 0)
    assert valid and l0.tolist() == [[0]] and l1.tolist() == [[4095, 1]] and l2.tolist() == [[17, 4000, 2, 3]]
    assert len(tokens) == TOKENS_PER_FRAME


def test_restricted_sampling_equals_masked_full_vocabulary():
    """Constrained decoding samples over 4097 candidate logits only; the seeded result equals sampling
    the full vocabulary with every other logit masked (and the same repetition penalty)."""
    from mstar.layers.sampling import SamplingParams, sample
    from mstar.model import EngineInputs
    from mstar.models.llama.nodes import LMArgs
    from mstar.models.llama.request import LMRequest
    from mstar.models.orpheus.codec import CODE_SIZE

    node = resolve_model("orpheus-tiny").build_submodules(["LLM"])["LLM"]
    g = torch.Generator().manual_seed(0)
    last = torch.randn(5, node.config.hidden_size, generator=g)
    steps = [0, 3, 6, 7, 40]
    sp = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=s) for s in range(5)]
    seen = [torch.tensor([STOP_TOKEN, AUDIO_TOKEN_BASE + 5, AUDIO_TOKEN_BASE + 3 * 4096 + 7, 42]) for _ in range(5)]
    ei = EngineInputs(walks=["decode"] * 5, nodes=["LLM"] * 5, request_ids=list("abcde"), infos=[], splits={},
                      args=[LMArgs(LMRequest(s, ()), step, t) for s, step, t in zip(sp, steps, seen)])
    restricted = node.sample_next(last, ei)
    logits = node.compute_logits(last)
    mask = torch.full_like(logits, float("-inf"))
    for r, step in enumerate(steps):
        lo = AUDIO_TOKEN_BASE + (step % 7) * CODE_SIZE
        mask[r, lo:lo + CODE_SIZE] = 0
        mask[r, STOP_TOKEN] = 0
    full = sample(logits + mask, sp, [s.tolist() for s in seen], steps)
    assert restricted.tolist() == full.tolist()


def test_codec_on_its_own_rank_gives_the_same_audio():
    prompts = [{"input_ids": torch.tensor(p)} for p in PROMPTS[:2]]
    params = {"max_tokens": 63, "sampling": {"seed": 5}}
    with Runtime(resolve_model("orpheus-tiny")) as rt:
        one = [torch.cat(o.tensors("audio")) for o in rt.generate(prompts, params)]
    placement = Placement.load(ROOT / "examples" / "placements" / "orpheus_codec_rank.yaml")
    placement = Placement.from_dict({**placement.to_dict(), "model": "orpheus-tiny"})
    with Runtime(resolve_model("orpheus-tiny"), placement) as rt:
        outs = rt.generate(prompts, params)
        ranks = rt.stats()["ranks"]
        assert "snac_decoder" in ranks[1]["batch_sizes"] and "LLM" in ranks[0]["batch_sizes"]
    for a, o in zip(one, outs):
        b = torch.cat(o.tensors("audio"))
        assert a.shape == b.shape and a.numel() > 0
        assert int((a.int() - b.int()).abs().max()) <= 1  # windows may batch differently: float noise
