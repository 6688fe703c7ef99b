"""Constrained decoding (``response_format``, ``/generate``'s ``grammar``) through llguidance: the
OpenAI SDK's ``parse`` against the real SmolLM2-135M, constrained and free requests in one batch, the
matcher state rebuilt from a request's tokens, and bad schemas as 400s naming the field."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pydantic
import pytest
import torch

from mstar import Runtime
from mstar.layers.grammar import GrammarMatchers, GrammarRow, GrammarSpec
from mstar.model import resolve_model
from mstar.models.llama.tokenizer import ByteTokenizer
from mstar.server.media import tensor_from_json
from tests.helpers import kv_blocks_in_use
from tests.server_utils import running_server


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=20)


PEOPLE = ["Ann, 31, from Oslo", "Bob, 45, from Lyon", "Chen, 28, from Wuhan", "Dana, 60, from Austin",
          "Emil, 19, from Bern", "Fatima, 37, from Rabat", "Goran, 52, from Split", "Hana, 24, from Brno",
          "Ivan, 33, from Kazan", "Jo, 70, from Leeds", "Kofi, 41, from Accra", "Lena, 29, from Graz",
          "Mateo, 35, from Cusco", "Nia, 22, from Cardiff", "Omar, 48, from Cairo", "Priya, 26, from Pune",
          "Quinn, 39, from Cork", "Rosa, 55, from Porto", "Sami, 30, from Turku", "Tariq, 44, from Amman"]


@pytest.fixture(scope="module")
def smollm2():
    with running_server(resolve_model("smollm2-135m"), "smollm2-135m") as (url, engine):
        yield url, engine


def test_sdk_parse_with_a_pydantic_model_20_of_20(smollm2):
    """``client.chat.completions.parse(response_format=Person)``: 20 prompts, run concurrently (one
    batch), each answer is JSON that validates as a Person."""
    url, engine = smollm2
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    def ask(who: str):
        msgs = [{"role": "user", "content": f"Give the name, age and city of this person as JSON: {who}"}]
        return client.chat.completions.parse(model="smollm2-135m", messages=msgs, response_format=Person,
                                             max_tokens=80)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, PEOPLE))
    parsed = [a.choices[0].message.parsed for a in answers]
    assert all(isinstance(p, Person) for p in parsed), [a.choices[0].message.content for a in answers]
    assert all(a.choices[0].finish_reason == "stop" for a in answers)
    assert sum(p.name.split()[0] in who for p, who in zip(parsed, PEOPLE)) >= 10  # a real model reads the prompt
    assert kv_blocks_in_use(engine.runtime) == 0


def test_json_object_and_bad_schemas(smollm2):
    """``json_object`` gives a JSON object; a schema llguidance refuses, a json_schema without a name
    and an unknown format type are 400s naming response_format; a schema the model cannot finish in
    max_tokens ends with finish_reason "length" and the partial text."""
    url, _ = smollm2
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=120,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    short = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=3,
                                           response_format={"type": "json_object"})
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError, match="response_format: .*Unimplemented keys"):  # a keyword llguidance lacks
        client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {"type": "string"}, "then": {}}}})
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}},
                {"type": "yaml"}):
        with pytest.raises(openai.BadRequestError, match="response_format"):
            client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=5, response_format=fmt)


REGEXES = [r"[0-9]{3}-[a-z]{2}", r"(yes|no)!", r"[A-F]{4}", r"x[0-9]y"]


def test_constrained_and_free_requests_share_a_batch_and_free_tokens_are_unchanged():
    """llama-tiny (byte tokens, llguidance's token-bytes path): 8 free greedy requests alone, then
    batched with 8 regex-constrained ones in the same steps: the free tokens are the same, and each
    constrained answer matches its regex and ends (EOS) there."""
    prompts = [torch.tensor([1, 20 + i, 40 + 2 * i, 7]) for i in range(8)]
    free = {"max_tokens": 12, "sampling": {"temperature": 0.0, "ignore_eos": True}}
    tok = ByteTokenizer()
    with Runtime("llama-tiny") as rt:
        alone = [[int(t) for t in o.tensors("token")] for o in rt.generate([{"input_ids": p} for p in prompts], free)]
        constrained = [{"max_tokens": 12, "sampling": {"temperature": 0.0,
                                                       "grammar": {"type": "regex", "value": REGEXES[i % 4]}}}
                       for i in range(8)]
        with rt.held():  # all 16 arrive in the same step
            handles = [rt.submit({"input_ids": p}, free) for p in prompts]
            handles += [rt.submit({"input_ids": p}, c) for p, c in zip(prompts, constrained)]
        outs = [h.result() for h in handles]
        assert [[int(t) for t in o.tensors("token")] for o in outs[:8]] == alone
        assert max(rt.stats()["ranks"][-1]["batch_sizes"]["LLM"]) == 16
        for o, c in zip(outs[8:], constrained):
            ids = [int(t) for t in o.tensors("token")]
            assert ids[-1] == tok.eos_token_id
            assert re.fullmatch(c["sampling"]["grammar"]["value"], tok.decode(ids)), tok.decode(ids)
        assert kv_blocks_in_use(rt) == 0
        with pytest.raises(ValueError, match="invalid regex"):
            rt.submit({"input_ids": prompts[0]}, {"sampling": {"grammar": {"type": "regex", "value": "([a-"}}})
        with pytest.raises(ValueError, match="grammar type"):
            rt.submit({"input_ids": prompts[0]}, {"sampling": {"grammar": {"type": "ebnf", "value": "x"}}})


def test_generate_route_takes_a_grammar():
    with running_server(resolve_model("llama-tiny"), "llama-tiny") as (url, _):
        body = {"inputs": {"input_ids": [1, 72, 105]},
                "params": {"max_tokens": 10, "sampling": {"grammar": {"type": "regex", "value": "ab{1,3}c"}}}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.text.splitlines()]
        ids = [int(tensor_from_json(t, "token", 16, 2)[0]) for x in lines if x.get("name") == "token"
               for t in x["tensors"]]
        assert re.fullmatch("ab{1,3}c", ByteTokenizer().decode(ids))
        body["params"]["sampling"]["grammar"] = {"type": "json_schema", "value": {"type": "nope"}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and "json schema" in r.json()["error"]["message"]


def test_matcher_state_is_rebuilt_from_the_request_tokens():
    """The engine's per-request matcher follows the tokens a row brings: extended, it consumes the
    new ones; not extended (a recomputed or moved request), it starts again; released, it is gone."""
    tok = ByteTokenizer()
    engine = GrammarMatchers(lambda: tok, tok.vocab_size)
    spec = GrammarSpec("regex", "abc|abd")

    def allowed(generated):
        out = engine.mask_rows(torch.zeros(2, tok.vocab_size), [GrammarRow(1, "r", spec, generated)])
        assert torch.isfinite(out[0]).all()  # the free row is untouched
        return tok.decode(torch.isfinite(out[1]).nonzero().flatten().tolist())

    a, b = tok.encode("a", add_special_tokens=False), tok.encode("ab", add_special_tokens=False)
    assert allowed([]) == "a" and allowed(a) == "b" and allowed(b) == "cd"
    assert allowed(a) == "b"  # not an extension of "ab": rebuilt from the grammar
    engine.release("r")
    assert "r" not in engine._matchers


TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "Current weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {
              "name": "add", "description": "Add two integers",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                             "required": ["a", "b"], "additionalProperties": False}}}]


def test_tool_call_round_trip_through_the_sdk(smollm2):
    """tool_choice "required": the answer is one call of a listed tool with arguments that fit its
    parameters, finish_reason "tool_calls"; the call and the tool's result sent back give a text
    answer; a named tool_choice streams deltas that reassemble to the call the same request gets
    whole (greedy)."""
    url, engine = smollm2
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=TOOLS, tool_choice="required",
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "add")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"a", "b"})
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})}
    final = client.chat.completions.create(model="smollm2-135m", messages=[*msgs, choice.message, result],
                                           tools=TOOLS, tool_choice="none", max_tokens=30)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    named = {"type": "function", "function": {"name": "add"}}
    whole = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=TOOLS, tool_choice=named,
                                           max_tokens=60).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=TOOLS,
                                                 tool_choice=named, max_tokens=60, stream=True))
    parts = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert len(parts) >= 2 and {t.index for t in parts} == {0} and parts[0].id.startswith("call_")
    assert parts[0].function.name == whole.function.name == "add"
    assert "".join(t.function.arguments or "" for t in parts) == whole.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert kv_blocks_in_use(engine.runtime) == 0
    for bad, field in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                       ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                       ({"tools": [{"type": "code_interpreter"}]}, "tools")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=5,
                                           **{"tools": TOOLS, **bad})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=5, tool_choice="required")


def test_tool_turns_render_and_free_answers_parse():
    """The tools go into the system message, an assistant's call and a tool's result into ChatML
    turns; a free ("auto") answer's <tool_call> blocks are its calls, malformed ones stay text."""
    from mstar.models.llama.adapter import _text_of
    from mstar.models.llama.tools import parse_tool_calls, render_messages, tool_request

    tools = tool_request(TOOLS, "auto")
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    turns = render_messages([{"role": "user", "content": "1+2?"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "3"}], _text_of, tools)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool"]
    assert '"name": "get_weather"' in turns[0]["content"] and "<tools>" in turns[0]["content"]
    assert turns[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert turns[3]["content"] == "<tool_response>\n3\n</tool_response>"
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 4, "b": 5}}</tool_call> <tool_call>{oops}</tool_call>'
    (parsed,) = parse_tool_calls(text, forced=False)
    assert parsed.name == "add" and json.loads(parsed.arguments) == {"a": 4, "b": 5}
    assert parse_tool_calls("no calls here", forced=False) == ()
    assert tool_request(TOOLS, "none") is None and tool_request(TOOLS, "required").forced
    # a forced call's arguments hold only the declared parameters unless the schema says otherwise
    open_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    schema = json.loads(tool_request(open_tool, "required").grammar().source)
    assert schema["properties"]["arguments"]["additionalProperties"] is False
    open_tool[0]["function"]["parameters"]["additionalProperties"] = True
    schema = json.loads(tool_request(open_tool, "required").grammar().source)
    assert schema["properties"]["arguments"]["additionalProperties"] is True


def test_mstar_client_json_answers_and_tool_calls(smollm2):
    from mstar.client import MStarClient

    url, _ = smollm2
    with MStarClient(url) as client:
        schema = {**Person.model_json_schema(), "additionalProperties": False}
        r = client.chat([{"role": "user", "content": "Give the name, age and city of this person as JSON: Ann, 31, from Oslo"}], max_tokens=80,
                        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        assert Person.model_validate(r.json())
        r = client.chat([{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS, tool_choice="required",
                        max_tokens=60)
        assert r.finish_reason == "tool_calls" and r.tool_calls[0]["function"]["name"] in ("get_weather", "add")
