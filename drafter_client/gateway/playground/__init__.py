"""The playground: a page at the gateway's ``/`` that shows speculation at work.

Three static files in this folder (no build step): the page asks the gateway's own API for
everything (``/v1/specdec/settings``, ``/v1/chat/completions`` and ``/v1/completions`` with the
``specdec`` extension) with the key the user types, and inserts model output as text only. The
files are open, as ``/health`` is: they hold no data. A strict Content-Security-Policy allows
scripts and styles from these files alone, so even text that slipped into the page as HTML could
run nothing.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

# name -> media type: the only files served (no path from the request reaches the disk)
FILES = {"index.html": "text/html; charset=utf-8",
         "playground.js": "text/javascript; charset=utf-8",
         "playground.css": "text/css; charset=utf-8"}

HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return files(__name__).joinpath(name).read_bytes()


def add_playground(app: FastAPI) -> None:
    """``GET /`` (the page) and ``GET /playground/{name}`` (its script and style)."""
    contents = {name: _read(name) for name in FILES}

    async def page(_: Request) -> Response:
        return Response(contents["index.html"], media_type=FILES["index.html"],
                        headers=HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in FILES:
            return Response(b'{"error": {"message": "no such file", "type": '
                            b'"not_found_error", "param": null, "code": null}}',
                            status_code=404, media_type="application/json")
        return Response(contents[name], media_type=FILES[name], headers=HEADERS)

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground/{name}", asset, methods=["GET"], include_in_schema=False)
