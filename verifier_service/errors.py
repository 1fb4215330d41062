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
    """FastAPI's own validation errors (a route's parameters), as a body's would be. Bodies are
    read by ``json_route.read_body``, which answers 415 / 400 / 422 itself."""
    assert isinstance(exc, RequestValidationError)
    return error_response(*validation_problem(exc.errors()))


def validation_problem(errors: Any) -> tuple[int, str, str, str | None]:
    """(status, code, message, field) for a body's validation errors: 422 naming every bad
    field (``field``: the first)."""
    messages = [f"{_location(e)}: {e.get('msg', 'invalid')}" for e in errors]
    field = _location(errors[0]) if errors else None
    return 422, "invalid_request", "; ".join(messages), field


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Errors raised by the framework itself (unknown path, wrong method) in the verifier's
    error shape."""
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code,
                                                             f"http_{exc.status_code}")
    return error_response(exc.status_code, code, str(exc.detail), None)
