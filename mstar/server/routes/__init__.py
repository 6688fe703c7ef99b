"""The HTTP routes, one router per concept; ``create_app`` mounts them in this order."""

from __future__ import annotations

from mstar.server.routes import (
           chat,
           completions,
           generate,
           images,
           playground,
           policy,
           realtime,
           responses,
           speech,
           system,
           traces,
)

ROUTERS = (system.router, chat.router, completions.router, responses.router, speech.router, images.router,
           generate.router, policy.router, realtime.router, traces.router,
           playground.router)
