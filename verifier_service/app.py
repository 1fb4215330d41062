"""FastAPI app factory for the verifier. No state at import time: everything lives on app.state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

import orjson
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from shared.schema import (
    REPLICA_HEADER,
    CreateSessionRequest,
    CreateSessionResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
)
from verifier_service.errors import (
    VerifierError,
    validation_error_handler,
    verifier_error_handler,
)
from verifier_service.guards import OWNER_KEY, ApiKeyAuth, BodyLimit
from verifier_service.scheduler import Scheduler
from verifier_service.service import VerifierService
from verifier_service.settings import Settings
from verifier_service.target import TargetRunner

log = logging.getLogger(__name__)
T = TypeVar("T")


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        if hasattr(content, "model_dump"):
            content = content.model_dump()
        return orjson.dumps(content)


class ModelThread:
    """Runs model work on one dedicated thread, off the event loop, one call at a time."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


class ReplicaHeader:
    """Pure ASGI middleware: names the replica in every response (X-Verifier-Replica).
    (Starlette's BaseHTTPMiddleware costs about a millisecond per request.)"""

    def __init__(self, app: Any, name: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.lower().encode(), name.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


# Dependencies are async so FastAPI does not hop to a worker thread for each (about 0.5 ms).
async def get_service(request: Request) -> VerifierService:
    return request.app.state.service  # type: ignore[no-any-return]


async def get_scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler  # type: ignore[no-any-return]


async def get_model_thread(request: Request) -> ModelThread:
    return request.app.state.model_thread  # type: ignore[no-any-return]


async def get_owner(request: Request) -> str | None:
    """The API key (by its digest's name) that sent the request; None without auth."""
    return getattr(request.state, OWNER_KEY, None)


ServiceDep = Annotated[VerifierService, Depends(get_service)]
OwnerDep = Annotated[str | None, Depends(get_owner)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
ModelThreadDep = Annotated[ModelThread, Depends(get_model_thread)]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 415, 422, 429, 503)
}


def create_app(settings: Settings, runner: TargetRunner | None = None) -> FastAPI:
    """Build the verifier. ``runner`` lets tests share one loaded target between apps."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        model_thread = ModelThread()
        target = runner
        if target is None:
            target = await model_thread.run(TargetRunner.load, settings.model, settings.dtype,
                                            settings.device, settings.max_context,
                                            settings.kv_budget_tokens)
        service = VerifierService(target, settings)
        scheduler = Scheduler(
            target, model_thread.run,
            max_batch_size=settings.max_batch_size if settings.batching else 1,
            max_batch_tokens=settings.max_batch_tokens,
            batch_wait_ms=settings.batch_wait_ms if settings.batching else 0.0,
            max_queue=settings.max_queue,
        )
        scheduler.start()
        app.state.service, app.state.scheduler = service, scheduler
        app.state.model_thread = model_thread
        sweeper = asyncio.create_task(_expire_sessions(service, model_thread))
        try:
            yield
        finally:
            sweeper.cancel()
            await scheduler.stop()
            model_thread.shutdown()

    app = FastAPI(title="specdec verifier", version="0.1.0", lifespan=lifespan,
                  default_response_class=ORJSONResponse)
    replica = settings.replica_name or f"{socket.gethostname()}:{settings.port}"
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=settings.key_list())  # outside BodyLimit: auth first
    app.add_middleware(ReplicaHeader, name=replica)

    app.add_exception_handler(VerifierError, verifier_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(service: ServiceDep) -> dict[str, Any]:
        return {"status": "ready", "model": service.runner.name,
                "sessions": len(service.sessions)}

    @app.get("/v1/info", response_model=InfoResponse)
    async def info(service: ServiceDep) -> InfoResponse:
        return service.info()

    @app.get("/v1/metrics")
    async def metrics(service: ServiceDep, scheduler: SchedulerDep) -> dict[str, Any]:
        pool = service.runner.pool
        return {
            "batching": settings.batching, **scheduler.stats.to_dict(),
            "queued": scheduler.queue.qsize(), "sessions": len(service.sessions),
            "evicted_sessions": service.sessions.evicted,
            "expired_sessions": service.sessions.expired,
            "kv_slots": pool.num_slots, "kv_slots_free": pool.free_slots,
            "kv_slot_tokens": pool.slot_tokens, "kv_pool_bytes": pool.nbytes,
            "verify_calls": service.verify_calls, "replayed_calls": service.replayed_calls,
        }

    @app.post("/v1/sessions", response_model=CreateSessionResponse, responses=ERRORS)
    async def create_session(body: CreateSessionRequest, service: ServiceDep,
                             scheduler: SchedulerDep, owner: OwnerDep) -> CreateSessionResponse:
        """Open a session and prefill its prompt. Idempotent under a client-chosen
        ``session_id``: the same request again answers the same while the session is unused."""
        return await scheduler.submit(service.create_session_job(body, owner))  # type: ignore[no-any-return]

    @app.post("/v1/sessions/{session_id}/verify", response_model=VerifyResponse,
              responses=ERRORS)
    async def verify(session_id: str, body: VerifyRequest, service: ServiceDep,
                     scheduler: SchedulerDep, owner: OwnerDep) -> VerifyResponse:
        """Score a drafted block in one forward. Idempotent: ``position`` names the step; the
        same call again returns the same answer without advancing the session; another
        position than the session's gets 409 with the session's ``position``."""
        return await scheduler.submit(service.verify_job(session_id, body, owner))  # type: ignore[no-any-return]

    @app.delete("/v1/sessions/{session_id}", status_code=204, responses=ERRORS)
    async def delete_session(session_id: str, service: ServiceDep, scheduler: SchedulerDep,
                             model_thread: ModelThreadDep, owner: OwnerDep) -> Response:
        scheduler.forget(session_id)
        await model_thread.run(service.delete_session, session_id, owner)
        return Response(status_code=204)

    @app.post("/v1/generate", response_model=GenerateResponse, responses=ERRORS)
    async def generate(body: GenerateRequest, service: ServiceDep,
                       scheduler: SchedulerDep, owner: OwnerDep) -> GenerateResponse:
        return await service.generate(scheduler, body, owner)

    return app


async def _expire_sessions(service: VerifierService, model_thread: ModelThread,
                           every_s: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        dropped = await model_thread.run(service.sessions.expire_idle)
        if dropped:
            log.info("expired %d idle sessions", dropped)
