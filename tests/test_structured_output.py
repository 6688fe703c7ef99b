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
from mstar.layers.grammar import GrammarEngine, GrammarRow, GrammarSpec
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
    engine = GrammarEngine(lambda: tok, tok.vocab_size)
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
