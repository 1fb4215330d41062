"""One error type for the verifier, rendered as ``{"error": {"code", "message", "field"}}``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response


class VerifierError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 retry_after_s: int | None = None, position: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.retry_after_s = retry_after_s  # sent as Retry-After with 429 / 503
        self.position = position  # the session's position, with 409s, to resynchronise


def error_response(status: int, code: str, message: str, field: str | None = None,
                   retry_after_s: int | None = None, position: int | None = None) -> Response:
    error: dict[str, Any] = {"code": code, "message": message, "field": field}
    if position is not None:
        error["position"] = position
    body = {"error": error}
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return Response(orjson.dumps(body), status_code=status, media_type="application/json",
                    headers=headers)


async def verifier_error_handler(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, VerifierError)
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.retry_after_s,
                          exc.position)


def _location(error: dict[str, Any]) -> str:
    parts = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(parts) or "body"


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    """415: not sent as JSON; 400: sent as JSON but does not parse; 422: JSON of the wrong shape
    (the message names every bad field, ``field`` the first)."""
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and "json" not in content_type:
        return error_response(415, "unsupported_media_type", "the body must be JSON sent with "
                              f"content-type: application/json (got {content_type!r})", "body")
    return error_response(*validation_problem(exc.errors()))


def validation_problem(errors: Any) -> tuple[int, str, str, str | None]:
    """(status, code, message, field) for a body's validation errors: 400 when it is not JSON
    at all, else 422 naming every bad field (``field``: the first)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return (400, "invalid_json", "the body is not valid JSON: "
                f"{errors[0].get('ctx', {}).get('error', 'parse error')}", "body")
    messages = [f"{_location(e)}: {e.get('msg', 'invalid')}" for e in errors]
    field = _location(errors[0]) if errors else None
    return 422, "invalid_request", "; ".join(messages), field


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Errors raised by the framework itself (unknown path, wrong method, a body that cannot be
    decoded at all - bad UTF-8, nesting too deep) in the verifier's error shape."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and request.method == "POST":
        return error_response(400, "invalid_json", f"the body cannot be parsed as JSON "
                              f"({exc.detail})", "body")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code,
                                                             f"http_{exc.status_code}")
    return error_response(exc.status_code, code, str(exc.detail), None)
