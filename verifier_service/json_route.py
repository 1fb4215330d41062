"""The one way a JSON body enters the verifier: every route that takes one (create, verify,
generate) is a :class:`JsonRoute`, which reads the body by one set of rules and calls the
endpoint with the validated model.

The rules, the same for every such route:

- content type: ``application/json`` (any case; a ``charset`` other than UTF-8 is refused),
  else 415 ``unsupported_media_type``; ``text/plain;json`` or ``application/problem+json`` are
  not it;
- the body must be JSON as RFC 8259 has it, in UTF-8, decoded by orjson: bad syntax, NaN and
  Infinity, numbers beyond a double, lone surrogates, invalid UTF-8, a byte order mark, UTF-16,
  nesting deeper than 1024 are 400 ``invalid_json``, whose message says what and where;
- an empty body, a body that is not an object and an object of the wrong shape are 422
  ``invalid_request`` naming every bad field (``errors.validation_problem``, FastAPI's wording).

API keys and the body's size and deadline are checked before any route, by the middleware in
``guards.py``. A request refused here reaches no endpoint: nothing is scheduled and no session
changes. The reply is written with pydantic's serializer (JSON) and no second validation.

FastAPI still registers the route, so routing, the OpenAPI document (built from the endpoint's
signature and ``response_model``) and the exception handlers are as for any route; what it no
longer does per call is its own body decoding, dependency solving and reply validation - the
verify call is made once per drafted block by every client (``python -m scripts.bench calls``).
An endpoint of a JsonRoute takes ``body`` (its model), the path's parameters and, if it
wants it, ``request``; nothing else (checked when the route is registered).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, get_type_hints

import orjson
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import request_response

from verifier_service.errors import VerifierError, validation_problem

JSON = "application/json"
EXCERPT_BEFORE, EXCERPT_AFTER = 32, 16  # characters of the body quoted around a JSON error
M = TypeVar("M", bound=BaseModel)


def media_type_problem(content_type: str) -> str | None:
    """Why a request with this Content-Type is refused (415); None when it is JSON."""
    if content_type == JSON:
        return None
    media, _, parameters = content_type.partition(";")
    charset = "utf-8"
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() == JSON and charset in ("utf-8", "utf8"):
        return None
    return ("the body must be JSON sent with content-type: application/json (UTF-8) "
            f"(got {content_type!r})")


def json_problem(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """What orjson found wrong with ``raw``, and where, with the body around that place (ASCII,
    escaped)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        near = raw[max(0, bad.start - EXCERPT_BEFORE):bad.start + EXCERPT_AFTER]
        return (f"the body is not valid JSON: it is not UTF-8 ({bad.reason} at byte "
                f"{bad.start}, near {repr(near)[1:]})")
    at = max(0, min(exc.pos, len(text)))
    near_text = text[max(0, at - EXCERPT_BEFORE):at + EXCERPT_AFTER]
    return f"the body is not valid JSON: {exc.msg} at char {at}" + (
        f", near {ascii(near_text)}" if near_text else "")


async def read_body(request: Request, model: type[M]) -> M:
    """The request's body as ``model``, by the rules above; VerifierError otherwise."""
    problem = media_type_problem(request.headers.get("content-type", ""))
    if problem is not None:
        raise VerifierError(415, "unsupported_media_type", problem, "body")
    raw = await request.body()
    if not raw:  # as FastAPI words a missing body
        raise VerifierError(422, "invalid_request", "body: Field required", "body")
    try:
        decoded = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise VerifierError(400, "invalid_json", json_problem(raw, exc), "body") from None
    if not isinstance(decoded, dict):
        raise VerifierError(422, "invalid_request", "body: Input should be a valid dictionary "
                            "or object to extract fields from", "body")
    try:
        return model.model_validate(decoded)
    except ValidationError as exc:
        raise VerifierError(*validation_problem(exc.errors())) from None


class JsonRoute(APIRoute):
    """An APIRoute whose JSON body, if it has one, is read by :func:`read_body` (routes without
    a body are FastAPI's as usual)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        if self.body_field is not None:
            # Starlette's request wrapper: FastAPI's adds two exit stacks, for dependencies with
            # yield and uploaded files, which these routes do not have.
            self.app = request_response(self.get_route_handler())

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        if self.body_field is None:
            return super().get_route_handler()
        endpoint = self.endpoint
        names = set(inspect.signature(endpoint).parameters)
        path_names = set(self.param_convertors)
        if "body" not in names or not names <= {"body", "request"} | path_names \
                or not path_names <= names:
            raise TypeError(f"{self.path}: a JsonRoute's endpoint takes body, the path's "
                            f"parameters and request only (got {sorted(names)})")
        model = get_type_hints(endpoint)["body"]
        wants_request, status = "request" in names, self.status_code or 200

        async def handler(request: Request) -> Response:
            body = await read_body(request, model)
            extra = {"request": request} if wants_request else {}
            reply = await endpoint(body=body, **request.path_params, **extra)
            if isinstance(reply, Response):
                return reply
            return Response(reply.model_dump_json(), status_code=status, media_type=JSON)

        return handler
