"""``WS /v1/realtime`` with the official OpenAI SDK's realtime client (``client.realtime.connect``):
a text conversation kept across turns, spoken answers, cancelling a response, and bad events, each
answered with an ``error`` event while the session and the server go on."""

from __future__ import annotations

import base64
import json

import openai
import pytest
import websockets.sync.client

from tests.helpers import kv_blocks_in_use, until_response_done
from tests.server_utils import running_server
from tests.test_server import expected_text, wait_for
from tests.toy_server_models import SAMPLES_PER_TOKEN, ToyChat

MODEL = "toy-chat"


@pytest.fixture(scope="module")
def server():
    with running_server(ToyChat(), MODEL) as (url, serving):
        yield url, serving


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _say(conn, text: str, role: str = "user") -> None:
    conn.conversation.item.create(item={"type": "message", "role": role,
                                        "content": [{"type": "input_text", "text": text}]})


def _text(events, kind="response.output_text.delta") -> str:
    return "".join(e.delta for e in events if e.type == kind)


def test_a_text_conversation_keeps_its_turns(client, server):
    with client.realtime.connect(model=MODEL) as conn:
        created = conn.recv()
        assert created.type == "session.created" and created.session.model == MODEL
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 6})
        assert conn.recv().type == "session.updated"
        _say(conn, "hello")
        conn.response.create()
        first = until_response_done(conn)
        kinds = [e.type for e in first]
        assert kinds[:4] == ["conversation.item.added", "conversation.item.done", "response.created",
                             "response.output_item.added"]
        answer = _text(first)
        assert answer == expected_text("hello", 6)  # the chat completion's answer to the same prompt
        done = first[-1].response
        assert done.status == "incomplete"  # the toy always runs to max_output_tokens: the runtime's LENGTH
        assert done.usage.output_tokens == 6 and done.usage.input_tokens == len("hello")
        assert done.output[0].content[0].text == answer
        # the next turn sees the first: the user's text, the assistant's answer, the new text
        _say(conn, "more")
        conn.response.create(response={"max_output_tokens": 4})
        second = _text(until_response_done(conn))
        assert second == expected_text("hello" + answer + "more", 4)
    # a response's walks are traced under its id
    import httpx

    trace = httpx.get(f"{server[0]}/v1/requests/{done.id}/trace", timeout=30).json()
    assert len(trace["requests"]) == 1 and trace["requests"][0]["walks"]


def test_a_spoken_answer_streams_pcm16_and_its_transcript(client):
    with client.realtime.connect(model=MODEL) as conn:
        session = conn.recv().session
        assert session.output_modalities == ["audio"]  # a model with voices speaks by default
        _say(conn, "hi")
        conn.response.create(response={"max_output_tokens": 3})
        events = until_response_done(conn)
        pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
        assert len(pcm) == 2 * 3 * SAMPLES_PER_TOKEN  # int16, one chunk per token
        transcript = _text(events, "response.output_audio_transcript.delta")
        assert transcript == expected_text("hi", 3)
        assert any(e.type == "response.output_audio.done" for e in events)


def test_cancel_ends_the_response_and_frees_its_blocks(client, server):
    with client.realtime.connect(model=MODEL) as conn:
        conn.recv()
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        conn.recv()
        _say(conn, "a long one")
        conn.response.create(response={"max_output_tokens": 200})
        for event in conn:
            if event.type == "response.output_text.delta":
                break
        conn.response.cancel()
        done = until_response_done(conn)[-1].response
        assert done.status == "cancelled" and done.usage.output_tokens < 200
        conn.response.cancel()  # nothing in progress now
        err = conn.recv()
        assert err.type == "error" and err.error.code == "response_cancel_not_active"
        # the session goes on: a new response answers, and the cancelled one's KV blocks are back
        _say(conn, "again")
        conn.response.create(response={"max_output_tokens": 2})
        assert until_response_done(conn)[-1].response.status == "incomplete"
    wait_for(lambda: kv_blocks_in_use(server[1].runtime) == 0)


@pytest.mark.parametrize("frame, code", [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    (json.dumps({"type": "conversation.item.delete"}), "unknown_event_type"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}), "unsupported"),
    (json.dumps({"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}}), "unsupported"),
    (json.dumps({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}), "unsupported"),
    (json.dumps({"type": "session.update", "session": {"temperature": 9}}), "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}),
     "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}), "invalid_value"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "robot",
                                                              "content": [{"type": "input_text", "text": "x"}]}}),
     "invalid_value"),
    (json.dumps({"type": "response.create", "response": {"tools": []}}), "unsupported"),
])
def test_bad_events_get_an_error_event_and_the_session_goes_on(client, frame, code):
    with client.realtime.connect(model=MODEL) as conn:
        conn.recv()
        conn.send_raw(frame)
        err = conn.recv()
        assert err.type == "error" and err.error.code == code, err
        _say(conn, "ok")
        conn.response.create(response={"max_output_tokens": 2, "output_modalities": ["text"]})
        assert _text(until_response_done(conn)) == expected_text("ok", 2)


def test_a_response_while_one_runs_is_refused(client):
    with client.realtime.connect(model=MODEL) as conn:
        conn.recv()
        _say(conn, "first")
        conn.response.create(response={"max_output_tokens": 50, "output_modalities": ["text"]})
        conn.response.create()
        refused = [e for e in until_response_done(conn) if e.type == "error"]
        assert [e.error.code for e in refused] == ["conversation_already_has_active_response"]


def test_a_request_the_model_refuses_fails_its_response_only(client):
    with client.realtime.connect(model=MODEL) as conn:
        conn.recv()
        _say(conn, "x")
        conn.response.create(response={"max_output_tokens": 300, "output_modalities": ["text"]})  # past the context
        events = until_response_done(conn)
        assert [e.type for e in events if e.type == "error"] == ["error"]
        assert events[-1].response.status == "failed"
        conn.response.create(response={"max_output_tokens": 2, "output_modalities": ["text"]})
        assert until_response_done(conn)[-1].response.status == "incomplete"


def test_a_wrong_model_is_an_error_then_a_close(server):
    url = server[0].replace("http://", "ws://") + "/v1/realtime?model=other"
    with websockets.sync.client.connect(url) as ws:
        event = json.loads(ws.recv())
        assert event["type"] == "error" and event["error"]["code"] == "model_not_found"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            ws.recv()
        assert closed.value.rcvd.code == 1008


def test_a_client_that_leaves_mid_response_leaves_nothing_running(server):
    url, serving = server
    aborted = serving.metrics.aborted.labels(MODEL)
    before = aborted._value.get()
    ws_url = url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    with websockets.sync.client.connect(ws_url) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "bye"}]}}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 240,
                                                                    "output_modalities": ["text"]}}))
        while json.loads(ws.recv())["type"] != "response.output_text.delta":
            pass
    # the socket closed mid-answer: the session cancels the response, which aborts its request
    wait_for(lambda: serving.runtime.stats()["running_requests"] == 0 and kv_blocks_in_use(serving.runtime) == 0)
    assert serving.in_flight == 0 and aborted._value.get() == before + 1  # aborted, not run to its end


def test_an_oversize_event_closes_the_session_with_a_reason(server):
    from mstar.server.app import create_app
    from mstar.server.limits import ServerLimits
    from tests.server_utils import running_app

    with running_app(create_app(server[1], limits=ServerLimits(max_body_bytes=4096))) as url:
        ws_url = url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
        with websockets.sync.client.connect(ws_url) as ws:
            assert json.loads(ws.recv())["type"] == "session.created"
            ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 5000}]}}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                ws.recv()
            assert closed.value.rcvd.code == 1009 and "4096" in closed.value.rcvd.reason
        with websockets.sync.client.connect(ws_url) as ws:  # the next session is served
            assert json.loads(ws.recv())["type"] == "session.created"
