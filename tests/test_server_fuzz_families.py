"""The hostile-body fuzz of ``test_server_fuzz`` against real families' adapters (llama-tiny,
orpheus-tiny, vjepa2-ac-tiny, pi05-tiny; qwen3-omni-tiny on chat and /generate without audio out),
on the routes each serves and on one it does not: no 5xx, OpenAI's error shape, a healthy server
and no KV block held after. Derandomized, 20 examples a route."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import test_server_fuzz as fz
from tests.server_utils import running_server

FUZZ = settings(max_examples=20, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FAMILIES = ("llama-tiny", "orpheus-tiny", "vjepa2-ac-tiny", "pi05-tiny")


@pytest.fixture(scope="module", params=FAMILIES)
def server(request):
    from mstar.model import resolve_model

    with running_server(resolve_model(request.param), request.param) as (url, engine):
        yield url, engine, request.param
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
        fz._settled(engine)


def for_model(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """The shared strategies name the toy model; a body that names it names the family instead."""
    return st.tuples(bodies, st.sampled_from(FAMILIES)).map(
        lambda bm: {**bm[0], "model": bm[1]} if isinstance(bm[0], dict) and bm[0].get("model") == fz.MODEL
        else bm[0])


vjepa_inputs = st.fixed_dictionaries({}, optional={
    "frames": fz.tensor_obj | fz.junk, "context": fz.tensor_obj | fz.junk, "states": fz.tensor_obj | fz.junk,
    "actions": fz.tensor_obj | fz.junk, "goal": fz.tensor_obj | fz.junk})
pi05_inputs = st.fixed_dictionaries({}, optional={
    "images": fz.tensor_obj | fz.junk, "base_0_rgb": fz.tensor_obj | fz.junk, "state": fz.tensor_obj | fz.junk,
    "token_ids": fz.tensor_obj | fz.junk, "noise": fz.tensor_obj | fz.junk})
pi05_bodies = st.fixed_dictionaries({"inputs": pi05_inputs, "params": st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=12) | fz.junk, "seed": fz.small_int, "action_dim": fz.small_int})})
generate_bodies = fz.generate_bodies | pi05_bodies | st.fixed_dictionaries(
    {"inputs": vjepa_inputs, "params": st.fixed_dictionaries({}, optional={
        "task": st.sampled_from(["rollout", "plan"]) | fz.junk, "horizon": fz.small_int,
        "samples": fz.small_int, "topk": fz.small_int, "iterations": fz.small_int})})


@FUZZ
@given(body=for_model(fz.chat_bodies))
def test_chat_never_5xx(server, body):
    fz._post(server[0], "/v1/chat/completions", body)


@FUZZ
@given(body=for_model(fz.speech_bodies))
def test_speech_never_5xx(server, body):
    fz._post(server[0], "/v1/audio/speech", body)


@FUZZ
@given(body=generate_bodies)
def test_generate_never_5xx(server, body):
    fz._post(server[0], "/generate", body)


# qwen3-omni-tiny: chat and /generate; audio out is left out (a fuzzed audio request may run the
# talker's default 4096 steps) and so is the speech route, which always speaks.
@pytest.fixture(scope="module")
def omni_server():
    from mstar.model import resolve_model

    with running_server(resolve_model("qwen3-omni-tiny"), "qwen3-omni-tiny") as (url, engine):
        yield url
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
        fz._settled(engine)


def text_only(body):
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("modalities", "audio")}
        if body.get("model") == fz.MODEL:
            body["model"] = "qwen3-omni-tiny"
    return body


@FUZZ
@given(body=fz.chat_bodies.map(text_only))
def test_omni_chat_never_5xx(omni_server, body):
    fz._post(omni_server, "/v1/chat/completions", body)


@FUZZ
@given(body=fz.generate_bodies.map(lambda b: {**b, "params": {k: v for k, v in b["params"].items() if k != "audio"}}
                                   if isinstance(b, dict) and isinstance(b.get("params"), dict) else b))
def test_omni_generate_never_5xx(omni_server, body):
    fz._post(omni_server, "/generate", body)


# -- every field of every route has an effect or is refused -------------------------------------------
# A non-default value of each declared field of each OpenAI route's request model. The test fails
# when a model field has no entry here (a new field must be walked too).
FIELD_VALUES = {
    "/v1/chat/completions": {
        "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "repetition_penalty": 1.2, "seed": 3, "stop": "zz", "stop_token_ids": [5], "n": 2, "stream": True,
        "stream_options": {"include_usage": True}, "modalities": ["audio"], "audio": {"voice": "tara"},
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
        "logit_bias": {"5": 1.0}, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "functions": [{}],
        "function_call": "auto", "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
        "parallel_tool_calls": False, "cfg_text_scale": 2.0},
    "/v1/completions": {
        "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1.0},
        "logprobs": 2, "seed": 3, "stop": "zz", "stop_token_ids": [5], "ignore_eos": True, "n": 2, "best_of": 3,
        "echo": True, "suffix": "x", "stream": True, "stream_options": {"include_usage": True}, "min_p": 0.1},
    "/v1/responses": {
        "instructions": "be brief", "max_output_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_logprobs": 2,
        "stream": True, "store": False, "previous_response_id": "resp_unknown", "metadata": {"k": "v"},
        "text": {"format": {"type": "json_object"}}, "include": ["message.output_text.logprobs"],
        "tools": [{"type": "function"}], "tool_choice": "auto", "parallel_tool_calls": True,
        "truncation": "disabled", "user": "u1", "reasoning": {"effort": "low"}, "background": True, "seed": 1},
    "/v1/audio/speech": {
        "voice": "tara", "response_format": "pcm", "speed": 1.5, "stream_format": "sse", "max_tokens": 7,
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.2, "seed": 3, "cfg_text_scale": 2.0},
}
BASES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         "/v1/completions": {"prompt": "hi", "max_tokens": 2},
         "/v1/responses": {"input": "hi", "max_output_tokens": 2},
         "/v1/audio/speech": {"input": "hi", "max_tokens": 7}}


def test_request_models_are_walked_whole():
    from mstar.server import protocol as p

    models = {"/v1/chat/completions": p.ChatCompletionRequest, "/v1/completions": p.CompletionRequest,
              "/v1/responses": p.ResponsesRequest, "/v1/audio/speech": p.SpeechRequest}
    for path, model in models.items():
        missing = set(model.model_fields) - set(FIELD_VALUES[path]) - set(BASES[path]) - {"model", "input", "prompt"}
        assert not missing, f"{path}: give {sorted(missing)} a value in FIELD_VALUES"


def test_every_field_has_an_effect_or_is_refused(server):
    """Each field of each route this family serves, set alone to a non-default value (and an extra
    field nothing reads): a 200, or a 400 naming the field; never accepted and ignored, since the
    routes refuse what neither they nor the model's adapter read (``refuse_unread``)."""
    url, engine, name = server
    served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["routes"]
    outcomes = {}
    for path, values in FIELD_VALUES.items():
        if path not in served:
            continue
        for field, value in values.items():
            body = {**BASES[path], "model": name, field: value}
            if field == "top_logprobs" and path == "/v1/chat/completions":
                body["logprobs"] = True
            r = httpx.post(url + path, json=body, timeout=60)
            if r.status_code == 200:
                outcomes[(path, field)] = "ok"
                continue
            assert r.status_code == 400, (path, field, r.status_code, r.text)
            err = r.json()["error"]
            assert field in (err["param"] or "") + err["message"], (path, field, err)
            outcomes[(path, field)] = "refused"
    if "/v1/chat/completions" in served:
        assert outcomes[("/v1/chat/completions", "cfg_text_scale")] == "refused"  # an extra no model here reads
        assert outcomes[("/v1/chat/completions", "functions")] == "refused"  # the deprecated form
    if "/v1/completions" in served:
        assert outcomes[("/v1/completions", "min_p")] == "refused"
        assert outcomes[("/v1/completions", "logprobs")] == "ok"
    if "/v1/audio/speech" in served:
        assert outcomes[("/v1/audio/speech", "cfg_text_scale")] == "refused"
    fz._settled(engine)
