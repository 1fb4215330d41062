"""The verifier's HTTP routes. Each one reads the :class:`VerifierState` and hands model work to
the scheduler (jobs) or the model thread; none holds state of its own. The routes with a JSON
body (create, verify, generate) read it by the one set of rules of
:class:`verifier_service.json_route.JsonRoute` and find the state and the key's owner on the
request."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from shared.http.connections import disconnected
from shared.protocol.schema import (
    CreateSessionRequest,
    CreateSessionResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
)
from verifier_service.guards import OWNER_KEY
from verifier_service.json_route import JsonRoute
from verifier_service.scheduling import generate as target_alone
from verifier_service.scheduling.jobs import CreateSessionJob
from verifier_service.state import VerifierState
from verifier_service.telemetry import CONTENT_TYPE_LATEST


def state_of(request: Request) -> VerifierState:
    return request.app.state.verifier  # type: ignore[no-any-return]


def owner_of(request: Request) -> str | None:
    """The API key (by its digest's name) that sent the request; None without auth."""
    return request.scope.get("state", {}).get(OWNER_KEY)  # type: ignore[no-any-return]


# Dependencies are async so FastAPI does not hop to a worker thread for each.
async def get_state(request: Request) -> VerifierState:
    return state_of(request)


async def get_owner(request: Request) -> str | None:
    return owner_of(request)


StateDep = Annotated[VerifierState, Depends(get_state)]
OwnerDep = Annotated[str | None, Depends(get_owner)]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 415, 422, 429, 503)
}

router = APIRouter(route_class=JsonRoute)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> dict[str, Any]:
    """Open to probes even under API keys, so it says nothing else: the model and the sessions
    are in /v1/info and /v1/metrics, behind the keys (docs/deploy.md)."""
    return {"status": "ready"}


@router.get("/v1/info", response_model=InfoResponse)
async def info(state: StateDep) -> InfoResponse:
    return state.info()


@router.get("/v1/metrics")
async def metrics(state: StateDep) -> dict[str, Any]:
    return state.metrics()


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus text exposition (docs/metrics.md); key-protected like every other route."""
    return Response(request.app.state.telemetry.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/sessions", response_model=CreateSessionResponse, responses=ERRORS)
async def create_session(body: CreateSessionRequest, request: Request) -> CreateSessionResponse:
    """Open a session and prefill its prompt. Idempotent under a client-chosen
    ``session_id``: the same request again answers the same while the session is unused."""
    state = state_of(request)
    state.jobs.validator.check_create(body.protocol_version, body.prompt_ids, body.encoder_ids,
                                      body.prompt_length, body.sampling)
    return await state.scheduler.submit(  # type: ignore[no-any-return]
        CreateSessionJob(state.jobs, body, owner_of(request)))


@router.post("/v1/sessions/{session_id}/verify", response_model=VerifyResponse,
             responses=ERRORS)
async def verify(session_id: str, body: VerifyRequest, request: Request) -> VerifyResponse:
    """Score a drafted block in one forward. Idempotent: ``position`` names the step; the
    same call again returns the same answer without advancing the session; another
    position than the session's gets 409 with the session's ``position``."""
    state = state_of(request)
    return await target_alone.verify_call(state.jobs, state.scheduler, session_id, body,
                                          state.engine.info.eos_token_ids, owner_of(request))


@router.delete("/v1/sessions/{session_id}", status_code=204, responses=ERRORS)
async def delete_session(session_id: str, state: StateDep, owner: OwnerDep) -> Response:
    state.scheduler.forget((owner, session_id))
    await state.model_thread.run(state.jobs.sessions.remove, session_id, owner)
    return Response(status_code=204)


@router.post("/v1/generate", response_model=GenerateResponse, responses=ERRORS)
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse | Response:
    """Target-only decoding with the same sampling math: the baseline of every speedup. A
    caller that hangs up stops it at its next step (499, read by nobody)."""
    state, owner = state_of(request), owner_of(request)
    gone = asyncio.Event()
    watch = asyncio.ensure_future(_hang_up(request, gone))
    try:
        reply = await target_alone.generate(state.jobs, state.scheduler, body,
                                            state.engine.info.eos_token_ids, owner, gone)
    finally:
        watch.cancel()
    return Response(status_code=499) if gone.is_set() else reply


async def _hang_up(request: Request, gone: asyncio.Event) -> None:
    """Sets ``gone`` when the client disconnects."""
    await disconnected(request)
    gone.set()
