"""FastAPI app factory for the verifier. No state at import time: the lifespan builds it all."""

from __future__ import annotations

import socket
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.engines.target import Engine
from shared.http.connections import guarded_protocol
from shared.http.metrics import RequestMetrics
from shared.protocol.schema import REPLICA_HEADER
from verifier_service.errors import (
    VerifierError,
    http_error_handler,
    validation_error_handler,
    verifier_error_handler,
)
from verifier_service.guards import ApiKeyAuth, ShutdownAnswer, verifier_body_limit
from verifier_service.lifespan import make_lifespan
from verifier_service.routes import router
from verifier_service.settings import Settings
from verifier_service.state import ModelThread
from verifier_service.telemetry import Telemetry


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


def create_app(settings: Settings, engine: Engine | None = None,
               model_thread: ModelThread | None = None) -> FastAPI:
    """Build the verifier. ``engine`` lets tests share one loaded target between apps;
    ``model_thread``: the thread that loaded it, which then runs all its forwards."""
    telemetry = Telemetry()
    app = FastAPI(title="specdec verifier", version="0.1.0",
                  lifespan=make_lifespan(settings, engine, observer=telemetry,
                                          model_thread=model_thread))
    app.state.telemetry = telemetry
    telemetry.add_state(lambda: app.state.verifier.metrics()
                        if hasattr(app.state, "verifier") else None)
    replica = settings.replica_name or f"{socket.gethostname()}:{settings.port}"
    app.add_middleware(verifier_body_limit, max_bytes=settings.max_body_bytes,
                       timeout_s=settings.body_timeout_s)
    app.add_middleware(ApiKeyAuth, keys=settings.key_list())  # outside BodyLimit: auth first
    app.add_middleware(ShutdownAnswer)
    app.add_middleware(ReplicaHeader, name=replica)
    app.add_middleware(RequestMetrics, metrics=telemetry.http,  # outermost: sees every answer
                       routes=[(r.path_regex.pattern, r.path) for r in router.routes
                               if isinstance(r, APIRoute)])
    app.add_exception_handler(VerifierError, verifier_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    # The routes go on the app's own router (include_router would add FastAPI's matching of an
    # included router to every call, tens of microseconds), the verify call first: every client
    # makes it once per drafted block, and each route ahead of it is one more match.
    app.router.routes[:0] = sorted(router.routes, key=lambda r: getattr(r, "name", "") != "verify")
    return app


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for these settings (the CLI's server and the tests' use the same)."""
    return {
        "http": guarded_protocol(settings.http_parser, settings.header_timeout_s,
                                 settings.max_connections),
        # uvicorn's own bound (503 to every new request) only as a backstop for calls in flight
        "limit_concurrency": 4 * settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_s,
        "timeout_graceful_shutdown": max(1, round(settings.shutdown_grace_s)),
    }
