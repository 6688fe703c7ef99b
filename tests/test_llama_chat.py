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
    dec = _TextDecoder(tok, stop_ids={2})
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
    dec = _TextDecoder(tok, stop_ids={2}, stop=("END", "xyz"))
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
    held = _TextDecoder(ByteTokenizer(), stop_ids={2}, stop=("END",))
    parts = _feed_all(held, "xx EN")
    assert "".join(parts) == "xx EN" and parts[-1] == "EN" and not held.done  # the tail held, then flushed
    first = _TextDecoder(ByteTokenizer(), stop_ids={2}, stop=("ab",))
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


def test_logprobs_penalties_and_logit_bias_through_the_sdk(server):
    """The SDK's own fields against llama-tiny (greedy): penalties and a bias give the runtime's tokens
    for the same sampling; logprobs has one entry per token, the sampled token first among its top 3
    alternatives, streamed chunks carry the same entries; a +100 bias makes every token that one."""
    url, engine = server
    model = engine.runtime.model
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Hello!"}]
    ids = model.tokenizer.encode(ChatTemplate(None).render(msgs)[0])
    options = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "logit_bias": {"101": 3.0, "32": -2.0}}
    r = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=12, logprobs=True,
                                       top_logprobs=3, **options)
    sampling = {**options, "temperature": 0.0}
    (out,) = engine.runtime.generate([{"input_ids": torch.tensor(ids)}], {"max_tokens": 12, "sampling": sampling})
    want = [int(t) for t in out.tensors("token")]
    assert r.choices[0].message.content == model.tokenizer.decode(want)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    for entry, token in zip(content, want):
        assert entry.token == model.tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3 and entry.logprob == entry.top_logprobs[0].logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=12, logprobs=True,
                                                 top_logprobs=3, stream=True, **options))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    (x,) = model.tokenizer.encode("x", add_special_tokens=False)
    forced = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=6, logit_bias={str(x): 100})
    assert forced.choices[0].message.content == "x" * 6
    plain = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=4, logprobs=False)
    assert plain.choices[0].logprobs is None
    assert engine.runtime.stats()["running_requests"] == 0
    for bad, field in (({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"presence_penalty": 2.5}, "presence_penalty")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=2, **bad)


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


def _prefix_hits(engine) -> int:
    return sum(r["kv"]["LLM"]["prefix_hit_tokens"] for r in engine.runtime.stats()["ranks"])


def test_completions_through_the_sdk(server):
    """``completions.create`` against llama-tiny (greedy): the text is the runtime's tokens for the
    prompt encoded with its BOS; a list of id prompts with n=2 gives 4 choices in order, usage
    counting each prompt once, and the choices after the first reuse the prompt's KV blocks; echo,
    logprobs (legacy shape), stop and streaming; seeded choice j samples with seed + j."""
    url, engine = server
    model = engine.runtime.model
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ids = model.tokenizer.encode("Hello", add_special_tokens=True)
    (out,) = engine.runtime.generate([{"input_ids": torch.tensor(ids)}], {"max_tokens": 6})
    want = model.tokenizer.decode([int(t) for t in out.tensors("token")])
    r = client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=6)
    assert r.object == "text_completion" and r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
    assert client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=6,
                                     echo=True).choices[0].text == "Hello" + want

    long = [1] + [(7 * i) % 200 + 3 for i in range(40)]  # two full KV blocks of 16 and a partial one
    hits = _prefix_hits(engine)
    r = client.completions.create(model="llama-tiny", prompt=[long, [1, 72, 101]], max_tokens=5, n=3)
    assert [c.index for c in r.choices] == list(range(6))
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] == texts[2] and texts[3] == texts[4] == texts[5] != texts[0]
    assert r.usage.prompt_tokens == len(long) + 3 and r.usage.completion_tokens == 30
    assert _prefix_hits(engine) - hits >= 2 * 32  # choices 2 and 3 of the long prompt: its full blocks

    lp = client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=6, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)

    chunks = list(client.completions.create(model="llama-tiny", prompt=[long, [1, 72, 101]], max_tokens=5, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)}
    assert [streamed[i] for i in range(4)] == [texts[0], texts[0], texts[3], texts[3]]
    finish = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finish == dict.fromkeys(range(4), "length") and chunks[-1].usage.completion_tokens == 20

    printable = [i for i in range(1, len(want) - 1) if want[i:i + 2].isprintable() and want[i:i + 2].strip()]
    if printable:
        stop = want[printable[0]:printable[0] + 2]
        s = client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=6, stop=stop)
        assert s.choices[0].text == want[:want.find(stop)] and s.choices[0].finish_reason == "stop"

    seeded = client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=8, n=2, temperature=1.0, seed=7)
    single = client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=8, temperature=1.0, seed=8)
    assert seeded.choices[1].text == single.choices[0].text
    assert engine.runtime.stats()["running_requests"] == 0

    for bad, field in (({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"n": 9}, "n"),
                       ({"echo": True, "logprobs": 1}, "echo"), ({"logprobs": 21}, "logprobs")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="llama-tiny", prompt="Hello", max_tokens=2, **bad)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model="llama-tiny", prompt=[], max_tokens=2)


def test_chat_n_choices_share_the_prompt(server):
    """n=3 greedy chat choices are the same answer, indexed 0-2, prompt tokens counted once; the
    choices after the first reuse the prompt's KV blocks; streamed, each index reassembles it."""
    url, engine = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": "You are a terse assistant. " * 3}, {"role": "user", "content": "Hi"}]
    one = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=6)
    hits = _prefix_hits(engine)
    r = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=6, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 18
    assert _prefix_hits(engine) - hits >= 3 * 16 * (one.usage.prompt_tokens // 16)
    chunks = list(client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=6, n=2, stream=True))
    for i in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == i) == one.choices[0].message.content


def test_responses_through_the_sdk(server):
    """``responses.create`` / ``responses.stream`` against llama-tiny (greedy): the answer is the chat
    completion of the same messages (instructions as the system message); previous_response_id
    continues the conversation (the earlier answer in the prompt, its instructions not); the stream's
    events reassemble the same text; a truncated answer is "incomplete"; an unknown previous id, tools
    and json output are 400s naming the field."""
    url, engine = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    def chat(messages, n=6):
        return client.chat.completions.create(model="llama-tiny", messages=messages, max_tokens=n)

    first = client.responses.create(model="llama-tiny", input="Hello", instructions="be brief", max_output_tokens=6)
    want = chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}])
    assert first.output_text == want.choices[0].message.content and first.object == "response"
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert (first.usage.input_tokens, first.usage.output_tokens) == (want.usage.prompt_tokens, 6)
    second = client.responses.create(model="llama-tiny", previous_response_id=first.id, max_output_tokens=6,
                                     input=[{"role": "user", "content": [{"type": "input_text", "text": "more"}]}])
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "more"}]
    assert second.output_text == chat(history).choices[0].message.content
    assert second.previous_response_id == first.id
    with client.responses.stream(model="llama-tiny", input="Hello", instructions="be brief", max_output_tokens=6,
                                 top_logprobs=2) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == first.output_text
    assert [e.type for e in events][:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(final.output[0].content[0].logprobs) == 6
    assert engine.runtime.stats()["running_requests"] == 0
    not_stored = client.responses.create(model="llama-tiny", input="Hello", max_output_tokens=2, store=False)
    for bad, field in (({"previous_response_id": "resp_unknown"}, "previous_response_id"),
                       ({"previous_response_id": not_stored.id}, "previous_response_id"),
                       ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
                       ({"text": {"format": {"type": "json_object"}}}, "text"),
                       ({"reasoning": {"effort": "low"}}, "reasoning")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.responses.create(model="llama-tiny", input="x", max_output_tokens=2, **bad)


@pytest.mark.parametrize("route", ["text_completions", "chat_completions"])
def test_guidellm_style_bodies_get_the_tokens_asked_for(server, route):
    """The request bodies vLLM's load tool guidellm sends (streamed, usage included, max_tokens and
    max_completion_tokens both set, stop null, ignore_eos): the stream's usage holds exactly the
    tokens asked for, and the text deltas are there."""
    import httpx

    url, _ = server
    body = {"model": "llama-tiny", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 20,
            "max_completion_tokens": 20, "stop": None, "ignore_eos": True}
    if route == "text_completions":
        path, body = "/v1/completions", {**body, "prompt": "The quick brown fox"}
    else:
        path, body = "/v1/chat/completions", {
            **body, "messages": [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}]}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 20
    assert any(c.get("text") or c.get("delta", {}).get("content") for e in events for c in e["choices"])


def test_generate_params_nothing_reads_are_refused(server):
    """A params key no part of the model reads is refused by name, through Runtime.submit and /generate,
    instead of being ignored; the keys it does read pass."""
    import httpx

    url, engine = server
    with pytest.raises(ValueError, match=r"params \['temprature'\] are not read .* \['max_tokens', 'sampling'\]"):
        engine.runtime.submit({"input_ids": torch.tensor([1, 2])}, {"max_tokens": 2, "temprature": 0.5})
    body = {"inputs": {"input_ids": [1, 72, 105]}, "params": {"max_tokens": 2, "beam_width": 4}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "beam_width" in r.json()["error"]["message"]
    body["params"] = {"max_tokens": 2, "sampling": {"temperature": 0.0}}
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
