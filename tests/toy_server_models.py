"""A toy model with an API adapter for every route, built on the toy LM (tests only)."""

from __future__ import annotations

import torch

from mstar.model.adapter import (
    CHAT,
    GENERATE,
    IMAGE_EDITS,
    IMAGES,
    SPEECH,
    ApiAdapter,
    ApiRequest,
    AudioChunk,
    ImageOut,
    ItemDecoder,
    TextDelta,
)
from tests.toy_models import POISON, ToyLM

SAMPLES_PER_TOKEN = 240


def encode_text(text: str) -> list[int]:
    ids = [ord(c) % 29 + 1 for c in text]  # 1..29: never EOS (0) nor POISON (31)
    return ids + [POISON] if "poison" in text else ids


def decode_token(t: int) -> str:
    return chr(ord("a") + t % 26)


class _Decoder(ItemDecoder):
    def __init__(self, route: str, req: ApiRequest, audio: bool):
        self.route, self.req, self.audio = route, req, audio
        self.tokens: list[int] = []

    def feed(self, name, value):
        tok = int(value[0])
        self.tokens.append(tok)
        outs = []
        if self.route == CHAT:
            outs.append(TextDelta(decode_token(tok)))
        if self.route == SPEECH or (self.route == CHAT and self.audio):
            outs.append(AudioChunk(torch.full((SAMPLES_PER_TOKEN,), tok * 100, dtype=torch.int16), 24000))
        return outs

    def finish(self):
        if self.route in (IMAGES, IMAGE_EDITS) or (self.route == CHAT and self.req.params.get("image_out")):
            w, h = self.req.params["size"]
            base = sum(self.tokens) % 256
            return [ImageOut(torch.full((h, w, 3), base, dtype=torch.uint8))]
        return []


class ToyAdapter(ApiAdapter):
    routes = frozenset({CHAT, SPEECH, IMAGES, IMAGE_EDITS, GENERATE})
    voices = ("alice", "bob")
    default_voice = "alice"
    sample_rate = 24000

    def chat_request(self, body, images, audio):
        text = ""
        for m in body["messages"]:
            c = m["content"]
            text += c if isinstance(c, str) else "".join(p.get("text") or "" for p in c or [])
        ids = encode_text(text) + [int(img.float().mean()) % 29 + 1 for img in images] + [len(audio) + 1] * len(audio)
        if not ids:
            raise ValueError("messages contain no text")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 8
        if max_tokens + len(ids) > 250:
            raise ValueError(f"max_tokens {max_tokens} + prompt {len(ids)} exceeds the context of 250 tokens")
        sampling = {"temperature": body["temperature"] if body.get("temperature") is not None else 0.0}
        body.get("ignore_eos")  # read: the toy has no EOS, it always generates max_tokens
        if body.get("seed") is not None:
            sampling["seed"] = body["seed"]
        audio_out = bool(body.get("modalities") and "audio" in body["modalities"])
        params = {"max_tokens": max_tokens, "sampling": sampling, "audio": audio_out,
                  "image_out": bool(body.get("image_out")), "size": (4, 2)}
        return ApiRequest({"input_ids": torch.tensor(ids)}, params, prompt_tokens=len(ids))

    def speech_request(self, body):
        body.get("voice")  # read (the route checked it is one of ``voices``): the toy speaks every voice alike
        ids = encode_text(body["input"])
        if len(ids) > 200:
            raise ValueError("input is too long (200 characters at most)")
        return ApiRequest({"input_ids": torch.tensor(ids)}, {"max_tokens": int(body.get("max_tokens") or 6)},
                          prompt_tokens=len(ids))

    def image_request(self, body, image):
        body.get("seed")  # read: the toy's images are the same for every seed
        if body["width"] * body["height"] > 512 * 512:
            raise ValueError(f"size {body['width']}x{body['height']} exceeds 512x512")
        if len(body["prompt"]) > 200:
            raise ValueError("prompt is too long (200 characters at most)")
        ids = encode_text(body["prompt"]) + ([int(image.float().mean()) % 29 + 1] if image is not None else [])
        return ApiRequest({"input_ids": torch.tensor(ids)},
                          {"max_tokens": 4, "size": (body["width"], body["height"])}, prompt_tokens=len(ids))

    def new_decoder(self, route, request):
        return _Decoder(route, request, bool(request.params.get("audio")))


class ToyChat(ToyLM):
    name = "toy-chat"

    def api_adapter(self):
        return ToyAdapter()
