"""bagel-tiny behind the OpenAI API, driven by the OpenAI SDK: text-to-image, editing, image
understanding (streamed), images out of chat, and 400s for bad input."""

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from mstar.layers.prepack import prepack_requested
from mstar.models.bagel.model import BagelTiny
from tests.server_utils import running_server

MODEL = "bagel-tiny"


def png_bytes(seed=0, size=(52, 40)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def decode_b64_png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def as_tensor(png: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).copy())


@pytest.fixture(scope="module")
def server():
    with running_server(BagelTiny(), MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def tokens(engine, s: str) -> torch.Tensor:
    return torch.tensor(engine.runtime.model.tokenizer.encode(s), dtype=torch.long)


def test_text_to_image_through_the_sdk(server, client):
    _, engine = server
    r = client.images.generate(model=MODEL, prompt="a red cube", size="48x32", n=2,
                               extra_body={"seed": 7, "num_inference_steps": 4})
    assert len(r.data) == 2
    imgs = [decode_b64_png(d.b64_json) for d in r.data]
    assert imgs[0].shape == (32, 48, 3) and not np.array_equal(imgs[0], imgs[1])  # seeds 7 and 8
    (ref,) = engine.runtime.generate([{"text_ids": [tokens(engine, "a red cube")]}],
                                     {"target": "image", "height": 32, "width": 48, "seed": 7, "num_timesteps": 5})
    alone = ref.tensors("image_output")[0].numpy()
    if prepack_requested():  # row-invariant projections: the same pixels as the request alone
        assert np.array_equal(imgs[0], alone)
    else:  # F.linear's rounding changes with the batch: a pixel may truncate to its neighbour
        assert np.abs(imgs[0].astype(int) - alone.astype(int)).max() <= 1


def test_n_images_run_as_concurrent_requests(server, client):
    _, engine = server
    r = client.images.generate(model=MODEL, prompt="boats", size="16x16", n=4,
                               extra_body={"seed": 0, "num_inference_steps": 3})
    assert len(r.data) == 4
    hist = engine.runtime.stats()["ranks"][0]["batch_sizes"]["combine_cfg"]
    assert max(hist) >= 2  # the requests ran concurrently: their flow steps shared batches


def test_image_edit_through_the_sdk(server, client):
    _, engine = server
    png = png_bytes(1)
    r = client.images.edit(model=MODEL, image=("in.png", png, "image/png"), prompt="make it blue",
                           extra_body={"seed": 3, "num_inference_steps": 3})
    out = decode_b64_png(r.data[0].b64_json)
    model = engine.runtime.model
    w, h = model.vae_resize.target_size(52, 40)
    assert out.shape == (h, w, 3)  # an edit keeps its input's (resized) shape
    (ref,) = engine.runtime.generate([{"text_ids": [tokens(engine, "make it blue")], "images": [as_tensor(png)]}],
                                     {"target": "image", "seed": 3, "num_timesteps": 4, "order": ["image", "text"]})
    assert np.array_equal(out, ref.tensors("image_output")[0].numpy())


def test_image_understanding_streams_the_generated_text(server, client):
    _, engine = server
    png = png_bytes(2)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is this?"}]}]
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    (ref,) = engine.runtime.generate([{"text_ids": [tokens(engine, "what is this?")], "images": [as_tensor(png)]}],
                                     {"target": "text", "max_tokens": 8, "order": ["image", "text"]})
    ids = [int(t) for t in ref.tensors("text")]
    expected = engine.runtime.model.tokenizer.decode(ids)
    assert streamed == expected == r.choices[0].message.content
    assert r.usage.completion_tokens == len(ids)
    # usage counts the image's tokens too: its ViT patches and their start / end tokens
    text_only = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}]}])
    h, w = as_tensor(png).shape[:2]
    vit_tokens = engine.runtime.model._image_tokens(int(h), int(w))[1]
    assert vit_tokens > 2 and r.usage.prompt_tokens - text_only.usage.prompt_tokens == vit_tokens


def test_chat_can_answer_with_an_image(server):
    import httpx

    url, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "draw a boat"}], "modalities": ["image"],
            "seed": 1, "num_inference_steps": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    parts = r.json()["choices"][0]["message"]["content"]
    assert [p["type"] for p in parts] == ["image_url"]
    b64 = parts[0]["image_url"]["url"].split(",", 1)[1]
    assert decode_b64_png(b64).shape == (64, 64, 3)  # bagel-tiny's default size


@pytest.mark.parametrize("call, match", [
    (lambda c: c.images.generate(model=MODEL, prompt="x", size="30x30"), "multiple of 8"),
    (lambda c: c.images.generate(model=MODEL, prompt="x", size="1024x1024"), "multiple of 8 in"),
    (lambda c: c.images.generate(model=MODEL, prompt="x", size="32x32", extra_body={"guidance_scale": -1}),
     "cfg scales"),
    (lambda c: c.images.generate(model=MODEL, prompt="x", size="32x32", extra_body={"num_inference_steps": 0}),
     "num_inference_steps"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), "audio|wav"),
    # fields BAGEL's text decoding does not read are refused by name, not ignored
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                         extra_body={"repetition_penalty": 1.3}), "repetition_penalty"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2), "n is not"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                         extra_body={"cfg_text_scale": 2.0}), "cfg_text_scale"),
])
def test_bad_input_is_a_400(client, call, match):
    with pytest.raises(openai.BadRequestError, match=match):
        call(client)


def test_native_generate_route(server):
    import json

    import httpx

    url, engine = server
    ids = engine.runtime.model.tokenizer.encode("hello")
    img = np.arange(20 * 24 * 3, dtype=np.uint8).reshape(20, 24, 3)
    body = {"inputs": {"text_ids": ids, "images": {"dtype": "uint8", "shape": [20, 24, 3],
                                                    "data": base64.b64encode(img.tobytes()).decode()}},
            "params": {"target": "text", "max_tokens": 3, "order": ["image", "text"]}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lines = [json.loads(x) for x in r.text.splitlines() if x]
    assert lines[-1] == {"done": True} and [x["name"] for x in lines[:-1]] == ["text"] * 3
    bad = httpx.post(url + "/generate", json={"inputs": {"text_ids": [1]}, "params": {"target": "image",
                                                                                      "height": 3}}, timeout=60)
    assert bad.status_code == 400 and "multiple of 8" in bad.json()["error"]["message"]
