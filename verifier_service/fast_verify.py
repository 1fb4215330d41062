"""The verify call without FastAPI's per-request machinery: the hottest route, called once per
drafted block by every client.

FastAPI's route decodes the body with ``json``, validates the dict, solves the dependencies,
re-validates the returned model against ``response_model`` and serialises it, in Python, per
call (``python -m scripts.bench calls`` measures it). This endpoint decodes with orjson and
validates the dict (python mode, so the messages read as FastAPI's), reads the state and the
key's owner straight from the request, and writes the reply with orjson - the same bodies,
status codes and error shapes (``tests/test_fast_verify.py`` compares them with the FastAPI
route's, which stays registered behind this one so the OpenAPI document still describes it).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared.protocol.schema import VerifyRequest
from verifier_service.errors import error_response, validation_problem
from verifier_service.guards import OWNER_KEY
from verifier_service.scheduling.generate import verify_call

VERIFY_PATH = "/v1/sessions/{session_id}/verify"


async def verify(request: Request) -> Response:
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type:
        return error_response(415, "unsupported_media_type", "the body must be JSON sent with "
                              f"content-type: application/json (got {content_type!r})", "body")
    raw = await request.body()
    if not raw:  # as FastAPI words a missing body
        return error_response(422, "invalid_request", "body: Field required", "body")
    try:
        decoded = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return error_response(400, "invalid_json", f"the body is not valid JSON: {exc}", "body")
    if not isinstance(decoded, dict):
        return error_response(422, "invalid_request", "body: Input should be a valid dictionary "
                              "or object to extract fields from", "body")
    try:
        body = VerifyRequest.model_validate(decoded)
    except ValidationError as exc:
        return error_response(*validation_problem(exc.errors()))
    state = request.app.state.verifier
    owner = request.scope.get("state", {}).get(OWNER_KEY)
    reply = await verify_call(state.jobs, state.scheduler, request.path_params["session_id"],
                              body, state.engine.info.eos_token_ids, owner)
    return Response(orjson.dumps(reply.model_dump(mode="json")),
                    media_type="application/json")


def fast_routes() -> list[Any]:
    """Routes to put in front of the FastAPI ones (first match wins)."""
    return [Route(VERIFY_PATH, verify, methods=["POST"])]
