"""BAGEL behind the OpenAI API.

* ``POST /v1/chat/completions``: text and images in (in message order), text out, streamed; with
  ``"modalities": ["image"]`` the reply is a generated image instead.
* ``POST /v1/images/generations``: text-to-image at ``size``.
* ``POST /v1/images/edits``: the uploaded image then the prompt; the result keeps the input image's
  (resized) shape, so ``size`` is not used.

Extra body fields (OpenAI's SDK passes them with ``extra_body``): ``seed`` (image ``i`` of ``n`` uses
``seed + i``), ``num_inference_steps`` (flow steps; ``num_timesteps`` = steps + 1), ``guidance_scale``
(= ``cfg_text_scale``), ``image_guidance_scale`` (= ``cfg_img_scale``), and BAGEL's own names
``cfg_text_scale``, ``cfg_img_scale``, ``cfg_interval``, ``cfg_renorm_type``, ``cfg_renorm_min``,
``num_timesteps``, ``timestep_shift``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar.model.adapter import (
    CHAT,
    GENERATE,
    IMAGE_EDITS,
    IMAGES,
    ApiAdapter,
    ApiRequest,
    ImageOut,
    ItemDecoder,
    TextStreamDecoder,
    stop_strings,
    text_sampling_params,
)
from mstar.model.validation import check_int

_FLOW_FIELDS = ("cfg_text_scale", "cfg_img_scale", "cfg_interval", "cfg_renorm_type", "cfg_renorm_min",
                "num_timesteps", "timestep_shift")
_ALIASES = {"guidance_scale": "cfg_text_scale", "image_guidance_scale": "cfg_img_scale"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


def _flow_params(body: Mapping[str, Any]) -> dict[str, Any]:
    params = {k: body[k] for k in _FLOW_FIELDS if body.get(k) is not None}
    for theirs, ours in _ALIASES.items():
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    steps = body.get("num_inference_steps")
    if steps is not None:
        params["num_timesteps"] = check_int(steps, "num_inference_steps") + 1
    return params


class BagelAdapter(ApiAdapter):
    routes = frozenset({CHAT, IMAGES, IMAGE_EDITS, GENERATE})

    def __init__(self, model) -> None:
        self.model = model

    def _encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.model.tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)

    def _finish(self, inputs: dict[str, list], params: dict[str, Any], stop: tuple[str, ...] = ()) -> ApiRequest:
        request = self.model.parse_request(inputs, params)  # bad sizes, scales, vocab -> HTTP 400
        return ApiRequest(inputs, request, prompt_tokens=self.model.prompt_tokens(request), stop=stop)

    def chat_request(self, body, images, audio):
        if audio:
            raise ValueError(f"{self.model.name} takes text and images; audio input is not supported")
        texts, order, pending, img_iter = [], [], [], iter(images)

        def flush() -> None:
            if pending:
                texts.append(self._encode("\n".join(pending)))
                order.append("text")
                pending.clear()

        for m in body["messages"]:
            content = m.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
            for part in parts:
                if part.get("type") == "text":
                    pending.append(part.get("text") or "")
                elif part.get("type") == "image_url":
                    flush()
                    order.append("image")
            flush()  # each message is one text item, as the reference's interleaved inputs
        imgs = list(img_iter)
        if len(imgs) != order.count("image"):
            raise ValueError("image parts and decoded images do not match")
        if not texts and not imgs:
            raise ValueError("messages contain neither text nor images")
        params: dict[str, Any] = {"order": order}
        stop: tuple[str, ...] = ()
        if body.get("modalities") and "image" in body["modalities"]:
            if body.get("stop"):
                raise ValueError("stop strings apply to text answers, not to image generation")
            params.update(target="image", **_flow_params(body))
            if body.get("seed") is not None:
                params["seed"] = body["seed"]
        else:
            params.update(target="text", **text_sampling_params(body, {k: k for k in _SAMPLING_FIELDS}))
            stop = stop_strings(body)
        inputs: dict[str, list] = {}
        if texts:
            inputs["text_ids"] = texts
        if imgs:
            inputs["images"] = imgs
        return self._finish(inputs, params, stop)

    def image_request(self, body, image):
        params: dict[str, Any] = {"target": "image", **_flow_params(body)}
        seed = body.get("seed")
        if seed is not None:
            params["seed"] = check_int(seed, "seed", lo=0) + int(body.get("index", 0))
        inputs: dict[str, list] = {"text_ids": [self._encode(body["prompt"])]}
        if image is None:
            params["height"], params["width"] = int(body["height"]), int(body["width"])
        else:
            inputs["images"] = [image]
            params["order"] = ["image", "text"]
        return self._finish(inputs, params)

    def new_decoder(self, route, request):
        req = request.params  # a BagelRequest (parsed by _finish)
        if req.target == "image":
            return _ImageDecoder()
        stop = set(req.sampling.stop_token_ids) | {self.model.special_tokens.im_end}
        return TextStreamDecoder(self.model.tokenizer, stop, request.stop)


class _ImageDecoder(ItemDecoder):
    def feed(self, name, value):
        if name != "image_output":
            return []
        return [ImageOut(value[0])]
