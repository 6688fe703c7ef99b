"""Qwen3-Omni behind the OpenAI API: the adapter's request and output handling."""

from __future__ import annotations

import math

import pytest
import torch

from mstar.graph import FinishReason
from mstar.layers.sampling import SamplingParams
from mstar.model.adapter import CHAT, SPEECH, AudioChunk, TextDelta
from mstar.models.qwen3_omni import adapter as A
from mstar.models.qwen3_omni.media import MediaSettings
from mstar.models.qwen3_omni.prompt import AUDIO_SYSTEM_PROMPT, OmniTokenIds
from mstar.models.qwen3_omni.request import OmniRequest
from tests.helpers import until_response_done

IDS = OmniTokenIds()
IS, IE, NL = IDS.im_start, IDS.im_end, IDS.newline


class ByteTokenizer:
    """Text <-> byte values (special ids decode to nothing)."""

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class FakeModel:
    tokenizer = ByteTokenizer()
    media = MediaSettings()  # no preprocessor_config.json: the processors' defaults
    audio_window = 50

    def __init__(self):
        self.handed = []  # the params mappings the adapter had parsed

    def parse_request(self, inputs, params):
        """What the real model's parse makes of the fields these tests look at."""
        self.handed.append(params)
        stops = (IE, *params.get("sampling", {}).get("stop_token_ids", ()))
        return OmniRequest(SamplingParams(), stops, bool(params.get("audio")), params.get("voice", "ethan"))


@pytest.fixture
def adapter():
    return A.Qwen3OmniAdapter(FakeModel())


def _chat(adapter, messages, media_images=(), media_audio=(), **body):
    return adapter.chat_request({"model": "m", "messages": messages, **body}, list(media_images), list(media_audio))


def _segment(ids: list[int], role: int) -> list[int]:
    """The token ids of the first turn of ``role`` (after ``<|im_start|>role\\n``, up to ``<|im_end|>``)."""
    start = next(i for i in range(len(ids) - 1) if ids[i] == IS and ids[i + 1] == role) + 3
    return ids[start:ids.index(IE, start)]


def test_text_only_chat_has_no_speech_and_no_inserted_system_turn(adapter):
    req = _chat(adapter, [{"role": "user", "content": "hi"}], max_tokens=7, temperature=0.5)
    ids = req.inputs["input_ids"][0].tolist()
    assert ids == [IS, IDS.user, NL, *b"hi", IE, NL, IS, IDS.assistant, NL]
    assert adapter.model.handed == [{"sampling": {"temperature": 0.5}, "max_tokens": 7}]  # no "audio": text only
    assert req.prompt_tokens == len(ids)
    assert isinstance(req.params, OmniRequest)  # parsed by the model, submitted as it is


def test_audio_chat_adds_the_system_prompt_voice_and_talker_defaults(adapter):
    req = _chat(adapter, [{"role": "user", "content": "hi"}], modalities=["text", "audio"],
                audio={"voice": "Chelsie", "format": "wav"})
    ids = req.inputs["input_ids"][0].tolist()
    assert bytes(_segment(ids, IDS.system)).decode() == AUDIO_SYSTEM_PROMPT
    assert adapter.model.handed[-1] == {"sampling": {}, "audio": True, "voice": "chelsie", "talker_sampling": {}}
    own = _chat(adapter, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                modalities=["audio"])
    assert bytes(_segment(own.inputs["input_ids"][0].tolist(), IDS.system)) == b"be brief"
    assert own.params.voice == "ethan"  # the default voice


def test_talker_sampling_overrides_and_seed(adapter):
    _chat(adapter, [{"role": "user", "content": "x"}], modalities=["text", "audio"], seed=5,
                talker_temperature=0.0, talker_top_k=3, talker_max_tokens=40, code_predictor_top_p=0.5)
    handed = adapter.model.handed[-1]
    assert handed["talker_sampling"] == {"temperature": 0.0, "top_k": 3, "seed": 5, "max_tokens": 40}
    assert handed["code_predictor_sampling"] == {"top_p": 0.5}
    assert handed["sampling"] == {"seed": 5}
    _chat(adapter, [{"role": "user", "content": "x"}], modalities=["audio"], seed=5, talker_seed=6)
    assert adapter.model.handed[-1]["talker_sampling"] == {"seed": 6}


def test_unknown_voice_names_the_choices(adapter):
    with pytest.raises(ValueError, match="unknown voice 'bob'; choose one of: chelsie, ethan, aiden"):
        _chat(adapter, [{"role": "user", "content": "x"}], modalities=["text", "audio"], audio={"voice": "bob"})


def _tone(seconds: float, rate: int) -> torch.Tensor:
    t = torch.arange(int(seconds * rate)) / rate
    return (0.3 * torch.sin(2 * math.pi * 440 * t) * 32767).to(torch.int16)


def test_media_inputs_become_features_and_placeholders(adapter):
    image = torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8)
    content = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
               {"type": "image_url", "image_url": {"url": ""}}, {"type": "text", "text": "what?"}]
    req = _chat(adapter, [{"role": "user", "content": content}], media_images=[image],
                media_audio=[(_tone(1.0, 24000), 24000)])
    ids = req.inputs["input_ids"][0].tolist()
    assert req.inputs["audio_features"][0].shape == (128, 100)  # 1 s at 16 kHz, hop 160
    assert ids.count(IDS.audio) == 13  # the audio tower's length for 100 mel frames
    assert req.inputs["image_grid_thw"][0].tolist() == [[1, 4, 6]]
    assert req.inputs["pixel_values"][0].shape == (24, 3 * 2 * 16 * 16)
    assert ids.count(IDS.image) == 24 // 4
    user = _segment(ids, IDS.user)
    assert user[0] == IDS.audio_start and user[14] == IDS.audio_end and user[15] == IDS.vision_start
    assert bytes(user[-5:]) == b"what?"


def test_bad_chat_requests(adapter):
    with pytest.raises(ValueError, match="role 'tool'"):
        _chat(adapter, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="user messages"):
        _chat(adapter, [{"role": "assistant", "content": [{"type": "image_url"}]}],
              media_images=[torch.zeros(32, 32, 3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="stop strings apply to text-only answers"):
        _chat(adapter, [{"role": "user", "content": "x"}], stop=["a"], modalities=["text", "audio"])
    with pytest.raises(ValueError, match="stop must be"):
        _chat(adapter, [{"role": "user", "content": "x"}], stop=[""])
    assert _chat(adapter, [{"role": "user", "content": "x"}], stop="a").stop == ("a",)  # text only: the decoder's
    with pytest.raises(ValueError, match="too short"):
        _chat(adapter, [{"role": "user", "content": [{"type": "input_audio"}]}], media_audio=[(_tone(0.01, 16000), 16000)])
    with pytest.raises(ValueError, match="at most"):
        _chat(adapter, [{"role": "user", "content": "x" * (A.MAX_PROMPT_TOKENS + 1)}])


def test_speech_goes_through_the_chat_prompt(adapter):
    req = adapter.speech_request({"model": "m", "input": "Hello there", "voice": "aiden", "speed": 1.0})
    ids = req.inputs["input_ids"][0].tolist()
    assert bytes(_segment(ids, IDS.system)).decode() == AUDIO_SYSTEM_PROMPT
    assert bytes(_segment(ids, IDS.user)).decode() == A.SPEECH_PROMPT.format(text="Hello there")
    assert req.params.voice == "aiden" and req.params.audio is True
    with pytest.raises(ValueError, match="characters"):
        adapter.speech_request({"input": "x" * (A.MAX_INPUT_CHARS + 1)})
    with pytest.raises(ValueError, match="speed"):
        adapter.speech_request({"input": "x", "speed": 2.0})
    with pytest.raises(ValueError, match="unknown voice"):
        adapter.speech_request({"input": "x", "voice": "tara"})


def test_decoder_turns_items_into_text_and_pcm16(adapter):
    req = _chat(adapter, [{"role": "user", "content": "x"}], modalities=["text", "audio"], max_tokens=3)
    decoder = adapter.new_decoder(CHAT, req)
    assert decoder.feed("text", [torch.tensor([ord("o")])]) == [TextDelta("o", 1)]
    [chunk] = decoder.feed("audio", [torch.tensor([0.0, 0.5, -1.0])])
    assert isinstance(chunk, AudioChunk) and chunk.sample_rate == 24000
    assert chunk.pcm.dtype == torch.int16 and chunk.pcm.tolist() == [0, 16384, -32767]
    assert decoder.feed("audio", [torch.zeros(0)]) == []
    decoder.feed("text", [torch.tensor([ord("k")])])
    decoder.feed("text", [torch.tensor([ord("!")])])
    decoder.end(FinishReason.LENGTH)  # the runtime's reason (the Thinker's stop flag), not a count here
    assert decoder.finish_reason == "length"
    stop = adapter.new_decoder(SPEECH, req)
    assert stop.feed("text", [torch.tensor([IE])]) == [TextDelta("", 1)]  # a stop token: counted, not shown
    stop.end(FinishReason.STOP)
    assert stop.finish_reason == "stop"


# ------------------------------------------------------------------ qwen3-omni-tiny through the OpenAI SDK

MODEL = "qwen3-omni-tiny"
GREEDY_SPEECH = {"talker_temperature": 0.0, "talker_max_tokens": 4}  # greedy talker -> greedy code predictor


@pytest.fixture(scope="module")
def server():
    from mstar.models.qwen3_omni.model import Qwen3OmniTiny
    from tests.server_utils import running_server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSTAR_KERNELS", "torch")  # no C++ kernel build in a fresh process
        with running_server(Qwen3OmniTiny(), MODEL) as (url, engine):
            yield url, engine


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _wav_samples(data: bytes) -> torch.Tensor:
    import io
    import wave

    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16)


def _audio_chat(client, text: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=6, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"}, extra_body=GREEDY_SPEECH, **kw)


def test_text_only_chat(server, client):
    from tests.helpers import kv_blocks_in_use

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert len(r.choices) == 1 and r.choices[0].message.audio is None
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("stop", "length")
    assert kv_blocks_in_use(server[1].runtime) == 0


def test_audio_chat_non_streaming_is_one_choice_with_a_24khz_wav(server, client):
    import base64

    r = _audio_chat(client, "hello")
    assert len(r.choices) == 1
    message = r.choices[0].message
    samples = _wav_samples(base64.b64decode(message.audio.data))
    frames = (samples.numel() + 555) // 1920
    assert frames >= 1 and samples.numel() == 1920 * frames - 555  # Code2Wav's exact length, no gaps
    assert frames <= GREEDY_SPEECH["talker_max_tokens"]
    assert message.audio.transcript == message.content
    assert message.audio.id


def test_audio_format_pcm16_returns_the_raw_samples(client):
    import base64

    wav = _audio_chat(client, "raw please").choices[0].message.audio.data
    raw = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "raw please"}], max_tokens=6,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}, extra_body=GREEDY_SPEECH)
    samples = torch.frombuffer(bytearray(base64.b64decode(raw.choices[0].message.audio.data)), dtype=torch.int16)
    assert torch.equal(samples, _wav_samples(base64.b64decode(wav)))


def test_audio_chat_streaming_equals_non_streaming(client):
    import base64

    whole = _audio_chat(client, "stream me").choices[0].message
    text, pcm = [], []
    for chunk in _audio_chat(client, "stream me", stream=True):
        delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        text.append(delta.get("content") or "")
        if delta.get("audio"):
            pcm.append(base64.b64decode(delta["audio"]["data"]))
    assert len(pcm) >= 1
    streamed = torch.frombuffer(bytearray(b"".join(pcm)), dtype=torch.int16)
    assert torch.equal(streamed, _wav_samples(base64.b64decode(whole.audio.data)))
    assert "".join(text) == whole.content


def test_speech_route_speaks_the_chat_reply(client):
    import base64

    speech = client.audio.speech.create(model=MODEL, voice="ethan", input="Good morning", response_format="wav",
                                        extra_body={"max_tokens": 6, **GREEDY_SPEECH})
    chat = _audio_chat(client, A.SPEECH_PROMPT.format(text="Good morning")).choices[0].message
    assert torch.equal(_wav_samples(speech.read()), _wav_samples(base64.b64decode(chat.audio.data)))


def test_bad_requests_are_400s(server, client):
    import base64

    import httpx

    url = server[0]
    bad_voice = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
                 "audio": {"voice": "bob", "format": "wav"}}
    r = httpx.post(url + "/v1/chat/completions", json=bad_voice, timeout=60)
    assert r.status_code == 400 and "choose one of: chelsie, ethan, aiden" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/audio/speech", json={"model": MODEL, "input": "x", "voice": "bob"}, timeout=60)
    assert r.status_code == 400 and "voice" in r.json()["error"]["message"]
    junk = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"}}
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": [junk]}]})
    assert r.status_code == 400 and "WAV" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/audio/speech", json={"model": MODEL, "input": "x" * 4001, "voice": "ethan"}, timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=long_chat, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    # fields the thinker does not read are refused by name, not ignored
    for field, value in (("ignore_eos", True), ("presence_penalty", 0.5), ("logprobs", True), ("n", 2),
                         ("audio", {"voice": "ethan"})):
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_audio_and_image_input_with_speech_out(server, client):
    import base64
    import io
    import wave

    from PIL import Image

    from tests.helpers import kv_blocks_in_use

    clip = io.BytesIO()
    with wave.open(clip, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(_tone(1.0, 24000).numpy().tobytes())
    png = io.BytesIO()
    Image.new("RGB", (96, 64), (200, 30, 90)).save(png, format="PNG")
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(clip.getvalue()).decode(),
                                                       "format": "wav"}},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                   + base64.b64encode(png.getvalue()).decode()}},
               {"type": "text", "text": "what is this?"}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4,
                                       modalities=["text", "audio"], audio={"voice": "aiden", "format": "wav"},
                                       extra_body=GREEDY_SPEECH)
    samples = _wav_samples(base64.b64decode(r.choices[0].message.audio.data))
    assert samples.numel() % 1920 == 1920 - 555
    # the prompt holds the 13 audio and 6 image placeholders of a 1 s clip and a 96 x 64 picture
    text_only = _audio_chat(client, "what is this?")
    assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + (13 + 2) + (6 + 2)
    assert kv_blocks_in_use(server[1].runtime) == 0


@pytest.mark.parametrize("extra, fragment", [
    ({"audio": {"voice": 5}}, "voice"),
    ({"talker_top_k": "many"}, "top_k"),
    ({"talker_temperature": -1}, "temperature"),
    ({"talker_max_tokens": 10 ** 7}, "context"),
    ({"code_predictor_top_p": 2.0}, "top_p"),
])
def test_hostile_speech_knobs_are_400s(server, extra, fragment):
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
            "max_tokens": 2, **extra}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def _audio_part(pcm: torch.Tensor) -> dict:
    """A chat message's ``input_audio`` part: ``pcm`` (int16, 24 kHz) as a WAV file."""
    import base64
    import io
    import wave

    f = io.BytesIO()
    with wave.open(f, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm.numpy().tobytes())
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(f.getvalue()).decode(), "format": "wav"}}


def test_realtime_spoken_turns_answer_as_the_chat_completion(client):
    """A turn streamed in 20 ms appends and committed gets the chat completion's answer for the same
    audio (greedy); the next turn sees it; a spoken answer streams audio and its transcript."""
    import base64

    pcm = _tone(1.0, 24000)
    audio_part = _audio_part(pcm)

    def chat(messages):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0)
        return r.choices[0].message.content

    def answer(conn, **response):
        conn.response.create(response={"max_output_tokens": 4, **response})
        return until_response_done(conn)

    first = chat([{"role": "user", "content": [audio_part]}])
    second = chat([{"role": "user", "content": [audio_part]}, {"role": "assistant", "content": first},
                   {"role": "user", "content": "and now?"}])
    with client.realtime.connect(model=MODEL) as conn:
        assert conn.recv().session.output_modalities == ["audio"]  # the model speaks by default
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "temperature": 0.0,
                                     "audio": {"input": {"turn_detection": None}}})  # the client commits
        assert conn.recv().session.audio.input.turn_detection is None
        for chunk in pcm.split(480):  # 20 ms at 24 kHz
            conn.input_audio_buffer.append(audio=base64.b64encode(chunk.numpy().tobytes()).decode())
        conn.input_audio_buffer.commit()
        committed = conn.recv()
        assert committed.type == "input_audio_buffer.committed"
        events = answer(conn)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "and now?"}]})
        events = answer(conn)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second
        # a spoken answer: pcm16 deltas and the transcript
        events = answer(conn, output_modalities=["audio"])
        audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
        transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
        assert len(audio) > 0 and events[-1].response.output[0].content[0].transcript == transcript
        # bad audio: an error event, the session goes on
        conn.input_audio_buffer.append(audio="AAE")  # not base64 of whole samples
        assert conn.recv().type == "error"
        conn.input_audio_buffer.commit()  # nothing buffered
        err = conn.recv()
        assert err.type == "error" and err.error.code == "input_audio_buffer_commit_empty"


def _spoken(text: str) -> torch.Tensor:
    """``text`` spoken by espeak-ng (Debian's ``espeak-ng``; the test skips without it), int16 at 24 kHz."""
    import shutil
    import subprocess
    import tempfile
    import wave

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng; `make test` does it where apt is)")
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-w", f.name, text], check=True)
        with wave.open(f.name) as w:
            rate = w.getframerate()
            pcm = torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16)
    n = round(pcm.numel() * 24000 / rate)
    resampled = torch.nn.functional.interpolate(pcm.float()[None, None], size=n, mode="linear", align_corners=False)
    return resampled[0, 0].round().clamp(-32768, 32767).to(torch.int16)


def test_realtime_server_vad_finds_the_turn_answers_it_and_barge_in_cancels(server, client):
    """Server VAD (Silero) over speech streamed in 20 ms appends: speech_started / stopped at the speech,
    the turn committed and answered with the chat completion's answer for that audio; speech during a
    response cancels it (barge-in) and is answered in turn."""
    import base64

    speech, silence = _spoken("Hello, how are you today? I would like to know the weather."), torch.zeros(12000,
                                                                                                         dtype=torch.int16)
    audio = torch.cat([silence, speech, silence, silence])

    def send(conn, pcm):
        for chunk in pcm.split(480):
            conn.input_audio_buffer.append(audio=base64.b64encode(chunk.numpy().tobytes()).decode())

    with client.realtime.connect(model=MODEL) as conn:
        assert conn.recv().session.audio.input.turn_detection.type == "server_vad"  # the default
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "temperature": 0.0,
                                     "max_output_tokens": 4})
        conn.recv()
        send(conn, audio)
        events = until_response_done(conn)
        kinds = [e.type for e in events]
        for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed", "response.created"):
            assert kind in kinds, kinds
        started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
        stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
        speech_ms = 1000 * speech.numel() // 24000
        assert 0 <= started.audio_start_ms <= 500 < stopped.audio_end_ms  # the speech starts at 500 ms
        assert 500 + speech_ms - 1000 <= stopped.audio_end_ms <= 500 + speech_ms + 1000
        answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        turn = audio[started.audio_start_ms * 24:stopped.audio_end_ms * 24]
        parts = [_audio_part(c) for c in turn.split(48000)]  # clips of 2 s (input_audio_segment_ms)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                           max_tokens=4, temperature=0.0)
        assert answer == r.choices[0].message.content
        # barge-in: speech while a long response streams cancels it; the new turn is answered
        conn.response.create(response={"max_output_tokens": 2000})
        for event in conn:
            if event.type == "response.output_text.delta":
                break
        send(conn, audio)
        first = until_response_done(conn)
        assert first[-1].response.status == "cancelled"
        assert any(e.type == "input_audio_buffer.speech_started" for e in first)
        second = until_response_done(conn)
        assert second[-1].response.status in ("completed", "incomplete")
    from tests.helpers import kv_blocks_in_use
    from tests.test_server import wait_for

    wait_for(lambda: kv_blocks_in_use(server[1].runtime) == 0)  # the cancelled response's blocks too


@pytest.mark.parametrize("output", ["text", "audio"])
def test_realtime_prefills_a_spoken_turn_while_it_is_spoken(server, client, output):
    """Each completed clip of a turn (``input_audio_segment_ms``) is prefilled before the commit; the
    response then reuses those blocks (prefix-cache hits through the clips' placeholders), and its
    answer equals the chat completion's for the same clips sent as ``input_audio`` parts. A spoken
    answer too: its prefills keep the Thinker's states at the clips, which its Talker reads (without
    them its prompt would be reused only up to the first clip); its pcm equals the chat completion's
    made first, without the cache (the session's temperature 0 and max_output_tokens bound the
    Talker as well)."""
    import base64

    runtime = server[1].runtime

    def thinker_hits():
        return sum(r["kv"]["Thinker"]["prefix_hit_tokens"] for r in runtime.stats()["ranks"] if "Thinker" in r["kv"])

    def turn(pcm):
        """(events, Thinker prefix-cache hits during the response) of ``pcm`` as a committed turn."""
        with client.realtime.connect(model=MODEL) as conn:
            conn.recv()
            conn.session.update(session={"type": "realtime", "output_modalities": [output], "temperature": 0.0,
                                         "max_output_tokens": 4, "input_audio_segment_ms": 500,
                                         "audio": {"input": {"turn_detection": None}}})
            assert conn.recv().session.model_dump()["input_audio_segment_ms"] == 500
            for chunk in pcm.split(480):
                conn.input_audio_buffer.append(audio=base64.b64encode(chunk.numpy().tobytes()).decode())
            before = thinker_hits()
            conn.input_audio_buffer.commit()
            conn.response.create()
            events = until_response_done(conn)
            return events, thinker_hits() - before

    def chat(pcm):  # the session's clips: two of 0.5 s, then 0.3 s
        messages = [{"role": "user", "content": [_audio_part(c) for c in (pcm[:12000], pcm[12000:24000],
                                                                          pcm[24000:])]}]
        if output == "text":
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0)
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0.0, modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"}, extra_body={"talker_temperature": 0.0, "talker_max_tokens": 4})

    tone = _tone(1.3, 24000)
    events, hits = turn(tone if output == "text" else tone.flip(0))  # audio no request has sent yet
    # the two complete clips' placeholders (7 rows each for 0.5 s) came from the prefills' blocks
    assert hits >= 2 * 7, hits
    if output == "text":
        answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert answer == chat(tone).choices[0].message.content
        return
    pcm = -tone  # its chat completion first: computed, not reused
    expected = chat(pcm).choices[0].message
    events, hits = turn(pcm)
    assert hits >= 2 * 7, hits
    spoken = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert spoken and spoken == base64.b64decode(expected.audio.data)
    assert transcript == expected.content


def test_realtime_input_audio_buffer_is_bounded(server):
    """Appends past ``ServerLimits.max_audio_samples`` get ``input_audio_buffer_full``; the buffer keeps
    what it held, and a commit of it is answered."""
    import base64
    import json

    import websockets.sync.client

    from mstar.server.app import create_app
    from mstar.server.limits import ServerLimits
    from tests.server_utils import running_app

    with running_app(create_app(server[1], limits=ServerLimits(max_audio_samples=24000))) as url:
        with websockets.sync.client.connect(url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}") as ws:
            json.loads(ws.recv())
            ws.send(json.dumps({"type": "session.update", "session": {
                "output_modalities": ["text"], "max_output_tokens": 2, "audio": {"input": {"turn_detection": None}}}}))
            json.loads(ws.recv())
            half = base64.b64encode(_tone(0.5, 24000).numpy().tobytes()).decode()
            for _ in range(2):
                ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": half}))
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": half}))  # 1.5 s: over the 1 s bound
            err = json.loads(ws.recv())
            assert err["type"] == "error" and err["error"]["code"] == "input_audio_buffer_full"
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            ws.send(json.dumps({"type": "response.create"}))
            kinds = []
            while not kinds or kinds[-1] != "response.done":
                kinds.append(json.loads(ws.recv())["type"])
            assert "input_audio_buffer.committed" in kinds and "error" not in kinds
