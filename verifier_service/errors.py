"""One error type for the verifier, rendered as ``{"error": {"code", "message", "field"}}``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
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
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and "json" not in content_type:
        return error_response(415, "unsupported_media_type", "the body must be JSON sent with "
                              f"content-type: application/json (got {content_type!r})", "body")
    errors = exc.errors()
    messages = [f"{_location(e)}: {e.get('msg', 'invalid')}" for e in errors]
    field = _location(errors[0]) if errors else None
    return error_response(422, "invalid_request", "; ".join(messages), field)
