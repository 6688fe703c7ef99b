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
