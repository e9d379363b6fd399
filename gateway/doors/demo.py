"""The demo page: ``GET /`` serves ``gateway/static/index.html`` and ``GET /static/{name}``
its scripts and stylesheet. Plain files, no build step; the page talks to the gateway's own
``/v1/models``, ``/v1/stream`` and, for its microphone button, ``/v1/audio/stream`` (the
audio is converted to 16 kHz PCM16 in ``static/mic-worklet.js``, an AudioWorklet), and
makes no other request. With a model that has a chat template (``/v1/models``:
``chat_template``) the page chats: each message goes out as ``messages`` with the
conversation's earlier turns, up to a history limit the page states; "New conversation"
forgets them. A model without one gets the raw prompt to complete.

The files are read once, when this module is imported; only the files that sit directly
in ``gateway/static`` at that moment are served, by exact name, so no path can reach
outside that folder.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

__all__ = ["router", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"  # gateway/static

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}

# Everything the page needs comes from this origin; WebSockets may only go back to it too
# (the page builds the URL from location.host), and nothing else is loaded.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self' ws: wss:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _load() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    if not STATIC_DIR.is_dir():
        return files
    for path in STATIC_DIR.iterdir():
        media_type = _MEDIA_TYPES.get(path.suffix.lower())
        if media_type and path.is_file() and not path.name.startswith("."):
            files[path.name] = (path.read_bytes(), media_type)
    return files


_FILES = _load()

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> Response:
    entry = _FILES.get("index.html")
    if entry is None:
        return Response("demo page not installed (gateway/static/index.html is missing)\n", status_code=404,
                        media_type="text/plain; charset=utf-8")
    return HTMLResponse(entry[0], headers=_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    entry = _FILES.get(name)  # exact names only: "..", "a/b" and the like are simply not in the table
    if entry is None:
        return Response("not found\n", status_code=404, media_type="text/plain; charset=utf-8")
    body, media_type = entry
    return Response(body, media_type=media_type, headers=_HEADERS)
