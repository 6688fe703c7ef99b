"""Where each BAGEL walk puts its tokens: the request's context layout, planned before it runs.

BAGEL's context is ONE KV cache grown item by item (text, ViT image, VAE image). RoPE positions are
not cache offsets: a text token takes one position, a whole image block takes one. The guidance
branches of the flow loop query two more contexts:

* ``cfg_text``: the main context as it was before the last prompt text (a PREFIX of the main cache,
  forked so it shares the main cache's pages);
* ``cfg_img``: the text items only, no images (its own cache, written alongside the main cache by
  the text prefills).

``plan_layout`` replays the reference inferencer's bookkeeping over a request's items once, when the
request arrives; every walk then gets a ``Ctx`` (as an int64 tensor input) naming the positions and
lengths its nodes need, so no node keeps per-request state.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch

from mstar.model.sendable import register_message

__all__ = ["Ctx", "LayoutStep", "plan_layout"]


@register_message  # inside a BagelRequest's layout
@dataclass
class Ctx:
    """Positions and lengths a walk's nodes need. All fields are ints (travels as an int64 tensor)."""

    rope: int = 0  # main context: next RoPE position
    length: int = 0  # main context: tokens in the cache
    text_rope: int = 0  # cfg_text context (the main cache's first ``text_len`` tokens)
    text_len: int = 0
    img_rope: int = 0  # cfg_img context (its own cache, text items only)
    img_len: int = 0
    write_img: int = 0  # prefill_text: also append the text to the cfg_img cache
    lat_h: int = 0  # image_gen: latent grid (tokens per column / row after patchifying)
    lat_w: int = 0
    text_alias: int = 0  # the cfg_text context IS the main context (its velocity equals the main one)
    img_alias: int = 0  # the cfg_img context IS the main context (no image in the context)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.long)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Ctx:
        values = [int(v) for v in t.reshape(-1).tolist()]
        if len(values) != len(fields(cls)):
            raise ValueError(f"ctx must hold {len(fields(cls))} ints, got {len(values)}")
        return cls(*values)


@register_message
@dataclass
class LayoutStep:
    walk: str
    item: int  # index into the request's items
    ctx: Ctx


def plan_layout(items: list[tuple[str, int, int]], target: str, cfg_img: bool,
                lat_hw: tuple[int, int] | None) -> tuple[list[LayoutStep], Ctx]:
    """The prefill walks of a request and the context of its final walk.

    ``items``: in order, ``("text", tokens, 0)`` (tokens including the wrapping specials) or
    ``("image", vae_tokens, vit_tokens)`` (each including the start/end-of-image tokens; ``vae_tokens``
    is ignored for text targets, which never VAE-encode). ``cfg_img``: the request runs the cfg_img
    branch, so text prefills also write the text-only context. ``lat_hw``: latent grid of the image to
    generate (image targets).
    """
    main_rope = main_len = img_rope = img_len = 0
    snap = (0, 0)  # (len, rope) of the cfg_text context: main before a text, or after an image
    has_image = False
    steps: list[LayoutStep] = []
    for i, (kind, a, b) in enumerate(items):
        if kind == "text":
            snap = (main_len, main_rope)
            steps.append(LayoutStep("prefill_text", i, Ctx(rope=main_rope, length=main_len, img_rope=img_rope,
                                                           img_len=img_len, write_img=int(cfg_img))))
            main_rope, main_len = main_rope + a, main_len + a
            if cfg_img:
                img_rope, img_len = img_rope + a, img_len + a
        elif kind == "image":
            has_image = True
            blocks = [("prefill_vae", a), ("prefill_vit", b)] if target == "image" else [("prefill_vit", b)]
            for walk, n in blocks:
                steps.append(LayoutStep(walk, i, Ctx(rope=main_rope, length=main_len)))
                main_rope, main_len = main_rope + 1, main_len + n  # one position per image block
            snap = (main_len, main_rope)
        else:
            raise ValueError(f"unknown item kind {kind!r}")
    h, w = lat_hw or (0, 0)
    final = Ctx(rope=main_rope, length=main_len, text_rope=snap[1], text_len=snap[0], img_rope=img_rope,
                img_len=img_len, lat_h=h, lat_w=w, text_alias=int(snap[0] == main_len),
                img_alias=int(not has_image))
    return steps, final
