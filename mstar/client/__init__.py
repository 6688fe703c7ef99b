"""A Python SDK for an mstar server: ``MStarClient`` (blocking) and ``AsyncMStarClient``, each a thin
layer over the documented HTTP API (``httpx``), one method per route, errors as ``MStarAPIError``.

    from mstar.client import MStarClient, image_part, user

    with MStarClient("http://127.0.0.1:8000") as client:
        print(client.chat([user("Describe this", image_part(png_bytes))], max_tokens=32).text)
"""

from mstar.client.async_client import AsyncMStarClient
from mstar.client.sync_client import MStarClient
from mstar.client.wire import (
    ChatDelta,
    ChatResult,
    GenerateItem,
    MStarAPIError,
    audio_part,
    image_part,
    text_part,
    user,
)

__all__ = ["AsyncMStarClient", "ChatDelta", "ChatResult", "GenerateItem", "MStarAPIError", "MStarClient",
           "audio_part", "image_part", "text_part", "user"]
