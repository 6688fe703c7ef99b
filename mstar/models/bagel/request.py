"""``BagelRequest``: a BAGEL request parsed once (``BagelModel.parse_request``): its target, the
settings its walks read (text sampling and stop ids, or the flow settings, seed and output type), and
its layout, planned once (the prefill walks' contexts, the final context, the latent grid): what
``create_state``, the fit and context checks, the adapter's prompt count and the nodes read."""

from __future__ import annotations

from dataclasses import dataclass

from mstar.layers.sampling import SamplingParams
from mstar.model.request import ModelRequest
from mstar.model.sendable import register_message
from mstar.models.bagel.flow import FlowSettings
from mstar.models.bagel.layout import Ctx, LayoutStep

__all__ = ["BagelLayout", "BagelRequest"]


@register_message
@dataclass(frozen=True)
class BagelLayout:
    """Where a request's items and answer sit in the LLM's contexts (``plan_layout``)."""

    order: tuple[str, ...]  # the item kinds, in order ("text", "image")
    steps: tuple[LayoutStep, ...]  # the prefill walks, in order
    ctx: Ctx  # the final walk's context
    lat_hw: tuple[int, int] | None  # the latent grid of the image to generate (image targets)


@register_message
@dataclass(frozen=True)
class BagelRequest(ModelRequest):
    target: str  # "text" or "image"
    layout: BagelLayout
    sampling: SamplingParams | None = None  # text: the decode's sampling
    flow: FlowSettings | None = None  # image: the generation settings
    seed: int | None = None  # image: the initial noise's seed (None: a fresh one)
    latent_out: bool = False  # image: emit the latents, not the decoded picture

    @property
    def gen_tokens(self) -> int:
        """Tokens the answer may add to the context (a text answer's and its end token)."""
        return self.sampling.max_tokens + 1 if self.target == "text" else 0
