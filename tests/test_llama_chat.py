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
