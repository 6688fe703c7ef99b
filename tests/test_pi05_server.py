"""pi0.5 over HTTP and openpi's websocket protocol: native ``/generate`` (observation in, actions
out), the policy route driven by ``openpi-client`` from PyPI, and bad observations answered with a
clear error while the server stays up. The policy is a fake with closed-form actions
(``tests/pi05_fake.py``), so every value that reaches the model is checked exactly."""

from __future__ import annotations

import base64

import httpx
import msgpack
import numpy as np
import pytest
import torch

from mstar.models.pi05 import inputs as pi
from mstar.server import media, policy_wire
from tests.pi05_fake import CONFIG, FakePolicy, expected_actions
from tests.server_utils import get, running_server
from tests.toy_server_models import ToyChat

websockets_client = pytest.importorskip("websockets.sync.client")
openpi = pytest.importorskip("openpi_client.websocket_client_policy")
# openpi-client 0.1.2 opens its connection without a context manager, which websockets >= 14 warns about
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")

S = CONFIG.vision.image_size
ACTION_STATS = pi.QuantileStats(q01=np.zeros(8, np.float32), q99=np.full(8, 2.0, np.float32))  # a -> a + 1


def _expected(base: float, right: float, token_sum: int, seed: int) -> np.ndarray:
    """The fake's actions when the base camera is all ``base`` and the right wrist all ``right`` (in
    [-1, 1]), the left wrist missing."""
    feat = torch.tensor([base, 0.0, right, float(token_sum), float(seed)])
    return expected_actions(feat).numpy()


def _uint8(value: int, h: int = S, w: int = S) -> np.ndarray:
    return np.full((h, w, 3), value, dtype=np.uint8)


def _t(array: np.ndarray) -> dict:
    return media.tensor_to_json(torch.from_numpy(np.ascontiguousarray(array)))


def _actions(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    lines = [line for line in resp.iter_lines() if line]
    import json

    items = [json.loads(x) for x in lines]
    assert items[-1] == {"done": True}
    (item,) = [x for x in items if x.get("name") == "actions"]
    (t,) = item["tensors"]
    assert t["dtype"] == "float32"
    return np.frombuffer(base64.b64decode(t["data"]), dtype=np.float32).reshape(t["shape"])


@pytest.fixture(scope="module")
def server():
    with running_server(FakePolicy(), "pi05-fake", api_key="k") as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def stats_server():
    with running_server(FakePolicy(stats=pi.NormStats(actions=ACTION_STATS)), "pi05-fake") as (url, engine):
        yield url, engine


def _post(url: str, body: dict, key: str | None = "k") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/generate", json=body, headers=headers, timeout=60)


OBS_BODY = {"inputs": {"base_0_rgb": _t(_uint8(255)), "right_wrist_0_rgb": _t(_uint8(0)),
                       "token_ids": [2, 5, 7], "state": [0.1, 0.2]},
            "params": {"seed": 3}}


def test_generate_observation_to_actions(server):
    url, _ = server
    a = _actions(_post(url, OBS_BODY))
    assert a.shape == (CONFIG.horizon, CONFIG.action_dim)
    np.testing.assert_allclose(a, _expected(1.0, -1.0, 14, 3), atol=1e-6)


def test_generate_resizes_with_padding(server):
    # a 28 x 56 white image is padded to 56 x 56 with black: half the pixels are 1, half -1 -> mean 0
    url, _ = server
    body = {"inputs": {"base_0_rgb": _t(_uint8(255, 28, 56)), "token_ids": [1]}, "params": {"seed": 0}}
    np.testing.assert_allclose(_actions(_post(url, body)), _expected(0.0, 0.0, 1, 0), atol=1e-6)


def test_generate_model_inputs_pass_through(server):
    url, _ = server
    images = torch.zeros(3, 3, S, S)
    images[0] = 0.5
    body = {"inputs": {"images": _t(images.numpy()), "image_masks": _t(np.array([True, False, False])),
                       "token_ids": [4, 4], "token_mask": _t(np.array([True, False]))}, "params": {"seed": 1}}
    np.testing.assert_allclose(_actions(_post(url, body)), _expected(0.5, 0.0, 4, 1), atol=1e-6)


def test_generate_unnormalises_and_slices_with_stats(stats_server):
    url, _ = stats_server
    a = _actions(_post(url, OBS_BODY, key=None))
    assert a.shape == (CONFIG.horizon, 8)
    np.testing.assert_allclose(a, _expected(1.0, -1.0, 14, 3)[:, :8] + 1.0, atol=1e-6)
    body = {**OBS_BODY, "params": {"seed": 3, "action_dim": 4}}
    assert _actions(_post(url, body, key=None)).shape == (CONFIG.horizon, 4)


def test_generate_seed_changes_the_result_deterministically(server):
    url, _ = server
    other = {**OBS_BODY, "params": {"seed": 4}}
    a, b, c = (_actions(_post(url, x)) for x in (OBS_BODY, other, OBS_BODY))
    assert np.array_equal(a, c) and not np.allclose(a, b)


NAN_STATE = {"dtype": "float32", "shape": [2],
             "data": base64.b64encode(np.array([0.0, np.nan], np.float32).tobytes()).decode()}


@pytest.mark.parametrize("inputs, params, match", [
    ({"base_0_rgb": _t(np.zeros((3, S, S), np.uint8)), "token_ids": [1]}, {}, "[H, W, 3]"),
    ({"token_ids": [1]}, {}, "at least one camera"),
    ({"base_0_rgb": _t(_uint8(1)), "state": NAN_STATE, "token_ids": [1]}, {}, "finite"),
    ({"base_0_rgb": _t(_uint8(1)), "state": [0.0]}, {"prompt": "pick"}, "tokenizer"),
    ({"base_0_rgb": _t(_uint8(1))}, {}, "prompt"),
    ({"base_0_rgb": _t(_uint8(1)), "token_ids": [CONFIG.vocab_size]}, {}, "token ids"),
    ({"base_0_rgb": _t(_uint8(1)), "token_ids": [1], "depth": [1]}, {}, "unknown input"),
    ({"base_0_rgb": _t(_uint8(1)), "token_ids": [1]}, {"seed": -1}, "seed"),
    ({"base_0_rgb": _t(_uint8(1)), "token_ids": [1]}, {"action_dim": 33}, "action_dim"),
    ({"base_0_rgb": _t(_uint8(1)), "token_ids": [1]}, {"prompt": "pick"}, "not both"),
    ({"base_0_rgb": _t(_uint8(1)), "token_ids": [1], "noise": [1.0]}, {}, "noise"),
])
def test_generate_bad_observation_is_400(server, inputs, params, match):
    url, _ = server
    r = _post(url, {"inputs": inputs, "params": params})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert match in r.json()["error"]["message"]


# -- openpi's websocket protocol ------------------------------------------------------------------------


def _ws(url: str) -> str:
    return url.replace("http://", "ws://")


DROID_OBS = {"observation/exterior_image_1_left": _uint8(255), "observation/wrist_image_left": _uint8(0),
             "observation/joint_position": np.zeros(7, np.float32),
             "observation/gripper_position": np.zeros(1, np.float32),
             "token_ids": np.array([2, 5, 7], np.int64), "seed": 3}


def test_openpi_client_round_trip(server):
    url, engine = server
    client = openpi.WebsocketClientPolicy(_ws(url), api_key="k")
    meta = client.get_server_metadata()
    assert meta["action_horizon"] == CONFIG.horizon and meta["cameras"][0] == "base_0_rgb"
    assert "droid" in meta["layouts"] and meta["tokenizer"] is False
    out = client.infer(DROID_OBS)
    assert out["actions"].dtype == np.float32 and out["actions"].shape == (CONFIG.horizon, CONFIG.action_dim)
    # DROID: exterior -> base camera (all 1), wrist -> left wrist (all -1), right wrist missing
    feat = torch.tensor([1.0, -1.0, 0.0, 14.0, 3.0])
    np.testing.assert_allclose(out["actions"], expected_actions(feat).numpy(), atol=1e-6)
    assert out["state"].shape == (8,) and out["server_timing"]["infer_ms"] > 0
    out2 = client.infer(DROID_OBS)  # a second call on the same connection reports the previous total
    assert np.array_equal(out2["actions"], out["actions"]) and out2["server_timing"]["prev_total_ms"] > 0


def test_openpi_client_libero_and_native_layouts(stats_server):
    url, _ = stats_server
    client = openpi.WebsocketClientPolicy(_ws(url))
    libero = {"observation/image": _uint8(255), "observation/wrist_image": _uint8(0),
              "observation/state": np.zeros(8, np.float32), "token_ids": np.array([2, 5, 7]), "seed": 3}
    native = {"image": {"base_0_rgb": _uint8(255), "left_wrist_0_rgb": _uint8(0)}, "state": np.zeros(8),
              "token_ids": [2, 5, 7], "seed": np.int64(3)}
    want = expected_actions(torch.tensor([1.0, -1.0, 0.0, 14.0, 3.0])).numpy()[:, :8] + 1.0
    for obs in (libero, native):
        np.testing.assert_allclose(client.infer(obs)["actions"], want, atol=1e-6)


BAD_OBSERVATIONS = {
    "wrong image shape": ({**DROID_OBS, "observation/exterior_image_1_left": np.zeros((3, S, S), np.uint8)},
                          r"[H, W, 3]"),
    "missing keys": ({"prompt": "pick up"}, "no camera image"),
    "nan state": ({**DROID_OBS, "observation/joint_position": np.full(7, np.nan, np.float32)}, "finite"),
    "half a state": ({k: v for k, v in DROID_OBS.items() if k != "observation/gripper_position"}, "every one of"),
    "unknown key": ({**DROID_OBS, "observation/depth": np.zeros(3)}, "unknown key"),
    "no prompt": ({k: v for k, v in DROID_OBS.items() if k != "token_ids"}, "prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_OBSERVATIONS))
def test_bad_observation_text_frame_then_1011_and_server_stays_up(server, case):
    url, _ = server
    obs, match = BAD_OBSERVATIONS[case]
    client = openpi.WebsocketClientPolicy(_ws(url), api_key="k")
    with pytest.raises(RuntimeError, match="Error in inference server") as e:
        client.infer(obs)
    assert match in str(e.value) and "error 400" in str(e.value)
    from websockets.exceptions import ConnectionClosedError

    with pytest.raises(ConnectionClosedError) as closed:
        client._ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1011
    fresh = openpi.WebsocketClientPolicy(_ws(url), api_key="k")  # the server goes on
    assert fresh.infer(DROID_OBS)["actions"].shape == (CONFIG.horizon, CONFIG.action_dim)
    assert get(url, "/healthz").text == "OK"


def _raw_exchange(url: str, frame: bytes | str) -> str:
    with websockets_client.connect(_ws(url), additional_headers={"Authorization": "Api-Key k"}) as ws:
        ws.recv()  # metadata
        ws.send(frame)
        reply = ws.recv()
        assert isinstance(reply, str)
        return reply


@pytest.mark.parametrize("frame, match", [
    (b"\xc1garbage", "msgpack"),
    ("a text frame", "binary frame"),
    (msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"\x00" * 5, b"dtype": "<f4",
                                          b"shape": [2, 2]}}), "does not match"),
    (msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"", b"dtype": "|O",
                                          b"shape": [0]}}), "not allowed"),
    (msgpack.packb([1, 2, 3]), "must be a map"),
])
def test_malformed_frames_are_refused(server, frame, match):
    url, _ = server
    assert match in _raw_exchange(url, frame)


def test_health_auth_and_models_without_the_route(server):
    url, _ = server
    assert get(url, "/healthz").text == "OK"
    from websockets.exceptions import InvalidStatus

    for headers in (None, {"Authorization": "Api-Key wrong"}):  # no key / a wrong one: handshake refused
        with pytest.raises(InvalidStatus) as refused:
            websockets_client.connect(_ws(url), additional_headers=headers)
        assert refused.value.response.status_code == 403
    with websockets_client.connect(_ws(url), additional_headers={"Authorization": "Bearer k"}) as ws:
        assert "action_horizon" in policy_wire.unpack(ws.recv())
    with running_server(ToyChat(), "toy-chat") as (toy_url, _):
        with pytest.raises(InvalidStatus):
            websockets_client.connect(_ws(toy_url))


def test_wire_round_trip_and_scalar():
    obj = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.float32(1.5), "c": "text", "d": [1, 2]}
    back = policy_wire.unpack(policy_wire.pack(obj))
    assert back["a"].dtype == np.int16 and np.array_equal(back["a"], obj["a"])
    assert back["b"] == np.float32(1.5) and back["b"].dtype == np.float32 and back["c"] == "text"
    with pytest.raises(ValueError, match="limit"):
        policy_wire.unpack(policy_wire.pack({"x": np.zeros(100)}), max_elements=10)
    with pytest.raises(ValueError, match="dtype"):
        policy_wire.pack({"x": np.zeros(2, np.complex64)})


# -- the real model: pi05-tiny ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    with running_server("pi05-tiny", "pi05-tiny") as (url, engine):
        yield url, engine


def _tiny_observation(seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.integers(0, 256, (S, S, 3), dtype=np.uint8), g.integers(0, 256, (S, S, 3), dtype=np.uint8)


def test_tiny_generate_observation_equals_model_inputs_and_frees_kv(tiny):
    from tests.helpers import kv_blocks_in_use

    url, engine = tiny
    base, wrist = _tiny_observation(0)
    ids = [2, 17, 301, 5, 9]
    obs = {"inputs": {"base_0_rgb": _t(base), "left_wrist_0_rgb": _t(wrist), "token_ids": ids}, "params": {"seed": 5}}
    a = _actions(_post(url, obs))
    assert a.shape == (CONFIG.horizon, CONFIG.action_dim) and np.isfinite(a).all()
    # the same request in the model's own terms, scaled here: uint8 / 255 * 2 - 1, channels first
    images = np.full((3, 3, S, S), -1.0, np.float32)
    images[0], images[1] = (base.transpose(2, 0, 1) / 255 * 2 - 1), (wrist.transpose(2, 0, 1) / 255 * 2 - 1)
    raw = {"inputs": {"images": _t(images), "image_masks": _t(np.array([True, True, False])), "token_ids": ids},
           "params": {"seed": 5}}
    np.testing.assert_allclose(_actions(_post(url, raw)), a, atol=1e-5)
    assert not np.allclose(_actions(_post(url, {**obs, "params": {"seed": 6}})), a)
    assert kv_blocks_in_use(engine.runtime) == 0


def test_tiny_openpi_round_trip_matches_generate(tiny):
    from tests.helpers import kv_blocks_in_use

    url, engine = tiny
    base, wrist = _tiny_observation(1)
    ids = np.array([2, 40, 41, 42], np.int64)
    noise = np.random.default_rng(2).standard_normal((CONFIG.horizon, CONFIG.action_dim)).astype(np.float32)
    client = openpi.WebsocketClientPolicy(_ws(url))
    droid = {"observation/exterior_image_1_left": base, "observation/wrist_image_left": wrist,
             "observation/joint_position": np.zeros(7), "observation/gripper_position": np.zeros(1),
             "token_ids": ids, "noise": noise}
    out = client.infer(droid)
    body = {"inputs": {"base_0_rgb": _t(base), "left_wrist_0_rgb": _t(wrist), "token_ids": ids.tolist(),
                       "noise": _t(noise)}}
    np.testing.assert_allclose(out["actions"], _actions(_post(url, body)), atol=1e-5)
    with pytest.raises(RuntimeError, match="finite"):
        client.infer({**droid, "observation/joint_position": np.full(7, np.nan)})
    fresh = openpi.WebsocketClientPolicy(_ws(url))
    np.testing.assert_allclose(fresh.infer(droid)["actions"], out["actions"], atol=1e-5)
    assert kv_blocks_in_use(engine.runtime) == 0


@pytest.mark.slow
def test_mstar_serve_policy_server_cli():
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.server_utils import free_port

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    refused = subprocess.run([sys.executable, "-m", "mstar.cli.main", "serve", "tests.toy_server_models:ToyChat",
                              "--workers", "inline", "--port", str(free_port()), "--policy-server"],
                             cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "does not serve the websocket policy protocol" in refused.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli.main", "serve", "pi05-tiny", "--workers", "inline",
                             "--port", str(port), "--policy-server"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).text == "OK":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openpi.WebsocketClientPolicy(f"ws://127.0.0.1:{port}")
        obs = {"image": {"base_0_rgb": _uint8(9)}, "token_ids": [2, 3], "seed": 1}
        assert client.infer(obs)["actions"].shape == (CONFIG.horizon, CONFIG.action_dim)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert "openpi websocket policy server on ws://" in proc.stderr.read()


# -- a prompt and a state, with the checkpoint's tokenizer and statistics -----------------------------


@pytest.fixture(scope="module")
def prompt_server(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text("\n".join(["Task: pick up the cube, State: 12 200 7;", "Action: ",
                                             "Task: Open the drawer, State: 1 2 3 4 5 6 7 8 9 0;"] * 30))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "paligemma_tokenizer"),
                                   vocab_size=48, model_type="bpe", bos_id=2, eos_id=1, pad_id=0, unk_id=3,
                                   minloglevel=2)
    stats = pi.NormStats(state=pi.QuantileStats(q01=np.array([-2.0, 0.0]), q99=np.array([2.0, 10.0])))
    sp = spm.SentencePieceProcessor(model_file=str(d / "paligemma_tokenizer.model"))
    with running_server(FakePolicy(stats=stats, tokenizer=pi.PromptTokenizer.find(d)), "pi05-fake") as (url, _):
        yield url, sp


def test_prompt_and_state_become_the_reference_prompt_tokens(prompt_server):
    url, sp = prompt_server
    state = [1.0, 2.5]  # normalised 2(x - q01)/(q99 - q01) - 1 = 0.5, -0.5 -> bins 192, 64
    text = "Task: Pick up the cube, State: 192 64;\nAction: "  # '_' -> ' ', case kept
    ids = [2, *sp.encode(text)]
    body = {"inputs": {"base_0_rgb": _t(_uint8(255)), "right_wrist_0_rgb": _t(_uint8(0)), "state": state},
            "params": {"prompt": " Pick_up the cube ", "seed": 3}}
    np.testing.assert_allclose(_actions(_post(url, body, key=None)), _expected(1.0, -1.0, sum(ids), 3), atol=1e-6)
    client = openpi.WebsocketClientPolicy(_ws(url))
    libero = {"observation/image": _uint8(255), "observation/state": np.array(state, np.float32),
              "prompt": " Pick_up the cube ", "seed": 3}
    want = expected_actions(torch.tensor([1.0, 0.0, 0.0, float(sum(ids)), 3.0])).numpy()
    np.testing.assert_allclose(client.infer(libero)["actions"], want, atol=1e-6)
    r = _post(url, {"inputs": {"base_0_rgb": _t(_uint8(1))}, "params": {"prompt": "pick"}}, key=None)
    assert r.status_code == 400 and "state" in r.json()["error"]["message"]
