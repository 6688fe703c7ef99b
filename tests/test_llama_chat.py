"""llama-tiny behind the OpenAI chat API: the text equals the runtime's tokens, decoded."""

import json

import openai
import pytest
import torch

from mstar import Runtime
from mstar.model import resolve_model
from mstar.models.llama.adapter import ChatTemplate, _TextDecoder
from mstar.models.llama.tokenizer import ByteTokenizer
from tests.server_utils import running_server


@pytest.fixture(scope="module")
def server():
    with running_server(resolve_model("llama-tiny"), "llama-tiny") as (url, engine):
        yield url, engine


def test_chat_text_is_the_generated_tokens_decoded(server):
    url, engine = server
    model = engine.runtime.model
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=10)
    prompt, _ = ChatTemplate(None).render(msgs)
    ids = model.tokenizer.encode(prompt)
    out = engine.runtime.generate([{"input_ids": torch.tensor(ids)}], {"max_tokens": 10})[0]
    expected = model.tokenizer.decode([int(t) for t in out.tensors("token")])
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=10, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_chat_errors(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="exceeds max_position_embeddings"):
        client.chat.completions.create(model="llama-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=100_000)
    from tests.test_server import png_data_url

    with pytest.raises(openai.BadRequestError, match="text model"):
        client.chat.completions.create(model="llama-tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url()}}]}])


def test_incremental_detokenizing_holds_back_partial_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("né€", add_special_tokens=False)  # multi-byte characters split over tokens
    dec = _TextDecoder(tok, max_tokens=100, stop_ids={2})
    text = "".join(d.text for i in ids for d in dec.feed("token", [torch.tensor([i])]))
    text += "".join(d.text for d in dec.finish())
    assert text == "né€" and "\ufffd" not in text
    assert dec.feed("token", [torch.tensor([2])])[0].text == "" and dec.finish_reason == "stop"


def _feed_all(dec, text):
    out = [d.text for i in ByteTokenizer().encode(text, add_special_tokens=False) if not dec.done
           for d in dec.feed("token", [torch.tensor([i])])]
    return out + [d.text for d in dec.finish()]


def test_stop_strings_cut_the_text_and_never_stream_a_part():
    """A stop string spread over several tokens: the text ends before it, no delta ever holds a
    piece of it (a tail that could become one waits), finish_reason is "stop" and the decoder is done;
    without a match every character comes out, the held tail at the end."""
    tok = ByteTokenizer()
    dec = _TextDecoder(tok, max_tokens=100, stop_ids={2}, stop=("END", "xyz"))
    sent, after = "", {}
    for i, ch in enumerate("abc ENxEND more"):
        for d in dec.feed("token", [torch.tensor(tok.encode(ch, add_special_tokens=False))]):
            sent += d.text
        after["abc ENxEND more"[:i + 1]] = sent
        if dec.done:
            break
    assert after["abc EN"] == "abc "  # "EN" may grow into "END": held back
    assert after["abc ENx"] == "abc EN"  # "x" ruled "END" out, but may start "xyz"
    assert after["abc ENxEN"] == "abc ENx" and sent == "abc ENx" and dec.done and dec.finish_reason == "stop"
    assert dec.finish() == [] and dec.feed("token", [torch.tensor([65])]) == []
    held = _TextDecoder(ByteTokenizer(), max_tokens=100, stop_ids={2}, stop=("END",))
    parts = _feed_all(held, "xx EN")
    assert "".join(parts) == "xx EN" and parts[-1] == "EN" and not held.done  # the tail held, then flushed
    first = _TextDecoder(ByteTokenizer(), max_tokens=100, stop_ids={2}, stop=("ab",))
    assert "".join(_feed_all(first, "abc")) == "" and first.done


def test_stop_strings_through_the_api(server):
    """Greedy llama-tiny: a stop string taken from the middle of its answer ends the answer right
    before it, streamed or not, with finish_reason "stop"; no KV block stays held; a bad stop is a
    400 naming it."""
    url, engine = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=24).choices[0].message.content
    printable = [i for i in range(4, len(full) - 3) if full[i:i + 3].isprintable() and full[i:i + 3].strip()]
    assert printable, full
    at = printable[len(printable) // 2]
    stop = full[at:at + 3]
    want = full[:full.find(stop)]
    r = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=24, stop=stop)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=24,
                                                 stop=[stop, "\x00never"], stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == want and all(stop not in d for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    stats = engine.runtime.stats()
    assert stats["running_requests"] == 0
    with pytest.raises(openai.BadRequestError, match="stop must be"):
        client.chat.completions.create(model="llama-tiny", messages=msgs, stop=["a", "b", "c", "d", "e"])


def test_checkpoint_chat_template_is_rendered(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}" \
               "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    text, has_specials = ChatTemplate(str(tmp_path)).render([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi<|assistant|>" and has_specials


def test_llama_tiny_generates_offline_by_name():
    with Runtime("llama-tiny") as rt:
        (out,) = rt.generate([{"input_ids": torch.tensor([1, 72, 105])}], {"max_tokens": 5})
        assert out.finished and len(out.tensors("token")) == 5
