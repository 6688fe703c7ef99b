"""BAGEL's image preprocessing: bounded-edge resize to a stride multiple, then ``[-1, 1]`` tensors.

BAGEL uses two instances: the VAE's ``BagelImageTransform(1024, 512, 16)`` and the ViT's
``BagelImageTransform(980, 224, 14)``. ``target_size`` is the size rule alone, so callers can plan
token counts without touching pixels.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from mstar.model.validation import check_int

__all__ = ["VAE_TRANSFORM_ARGS", "VIT_TRANSFORM_ARGS", "BagelImageTransform", "InputImageTransforms", "to_pil",
           "to_rgb"]

# (max_size, min_size, stride) of the two transforms BAGEL serves with.
VAE_TRANSFORM_ARGS = (1024, 512, 16)
VIT_TRANSFORM_ARGS = (980, 224, 14)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of ``image``; transparent pixels (RGBA, or a palette/L image with a transparency key)
    are composited onto white."""
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB")


def to_pil(image: torch.Tensor) -> Image.Image:
    """``[3, H, W]`` in ``[-1, 1]`` -> RGB PIL image (values are truncated to uint8, not rounded)."""
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"expected an image [3, H, W], got shape {tuple(image.shape)}")
    pixels = ((image.detach().float() * 0.5 + 0.5).clamp(0, 1) * 255).to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy())


class BagelImageTransform:
    """Resize (PIL bicubic) so both sides are multiples of ``stride``, the long edge at most ``max_size``,
    the short edge aimed at ``min_size`` or more, at most ``max_pixels`` in all; then to a float
    ``[3, H, W]`` tensor normalised with mean 0.5, std 0.5."""

    def __init__(self, max_size: int, min_size: int, stride: int, max_pixels: int = 14 * 14 * 9 * 1024) -> None:
        for name, value in (("max_size", max_size), ("min_size", min_size), ("stride", stride),
                            ("max_pixels", max_pixels)):
            check_int(value, name)
        self.max_size = max_size
        self.min_size = min_size
        self.stride = stride
        self.max_pixels = max_pixels

    def _snap(self, value: int) -> int:
        # Python's round (half to even) on purpose: it decides ties the same way as the reference.
        return max(self.stride, int(round(value / self.stride) * self.stride))

    def _scaled(self, width: int, height: int, scale: float) -> tuple[int, int]:
        return self._snap(round(width * scale)), self._snap(round(height * scale))

    def target_size(self, width: int, height: int, img_num: int = 1) -> tuple[int, int]:
        """``(new_width, new_height)`` for an input of ``width x height`` (``img_num`` images share the
        pixel budget)."""
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        scale = min(self.max_size / max(width, height), 1.0)
        scale = max(scale, self.min_size / min(width, height))
        new_w, new_h = self._scaled(width, height, scale)
        budget = self.max_pixels / img_num
        if new_w * new_h > budget:
            new_w, new_h = self._scaled(new_w, new_h, budget / (new_w * new_h))
        if max(new_w, new_h) > self.max_size:
            new_w, new_h = self._scaled(new_w, new_h, self.max_size / max(new_w, new_h))
        return new_w, new_h

    def resize(self, image: Image.Image, img_num: int = 1) -> Image.Image:
        """RGB (see ``to_rgb``), resized to ``target_size``."""
        image = to_rgb(image)
        size = self.target_size(*image.size, img_num=img_num)
        if size == image.size:
            return image
        return image.resize(size, Image.Resampling.BICUBIC)

    @staticmethod
    def to_tensor(image: Image.Image) -> torch.Tensor:
        """RGB PIL image -> ``[3, H, W]`` float32 in ``[-1, 1]`` (no resize)."""
        pixels = np.asarray(to_rgb(image), dtype=np.uint8)
        x = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255.0
        return (x - 0.5) / 0.5

    def __call__(self, image: Image.Image, img_num: int = 1) -> torch.Tensor:
        return self.to_tensor(self.resize(image, img_num=img_num))


class InputImageTransforms:
    """An input image's two views, as the reference makes them: resized for the VAE first, and the
    ViT's resized from that (``vae`` / ``vit``: uint8 ``[H, W, 3]`` -> normalised ``[3, h, w]``). The
    encoder nodes call them on their worker, not the runtime's control thread."""

    def __init__(self, vae: BagelImageTransform, vit: BagelImageTransform) -> None:
        self.vae_transform, self.vit_transform = vae, vit

    def _vae_sized(self, image: torch.Tensor) -> Image.Image:
        pixels = np.ascontiguousarray(image.to(torch.uint8).numpy())
        return self.vae_transform.resize(Image.fromarray(pixels, "RGB"))

    def vae(self, image: torch.Tensor) -> torch.Tensor:
        return self.vae_transform.to_tensor(self._vae_sized(image))

    def vit(self, image: torch.Tensor) -> torch.Tensor:
        return self.vit_transform(self._vae_sized(image))
