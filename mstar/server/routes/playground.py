"""``GET /playground``: a page to talk to the served model and see each answer's walk trace. Static
files in the package (``mstar/server/playground``): no build step, no CDN, everything offline. The
page needs no API key to load; its calls send the key the user types in."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from mstar.server.errors import APIError

router = APIRouter()

_DIR = Path(__file__).resolve().parents[1] / "playground"
_FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
          "playground.css": "text/css; charset=utf-8"}


@router.get("/playground", include_in_schema=False)
async def page():
    return FileResponse(_DIR / "index.html", media_type=_FILES["index.html"])


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in _FILES:
        raise APIError(404, f"no playground file {name!r}", code="not_found")
    return FileResponse(_DIR / name, media_type=_FILES[name])
