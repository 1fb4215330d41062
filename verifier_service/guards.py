"""Pure ASGI middleware that guards the verifier: API keys, the request body's size and
deadline (``shared.http.body_limit``), and an answer for calls cut off by shutdown.

They answer with the verifier's error body (``{"error": {"code", "message", "field"}}``) before
the request reaches FastAPI, so a rejected request costs no model time and touches no session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from typing import Any

from shared.http.auth import bearer_token
from shared.http.body_limit import BodyLimit
from verifier_service.errors import error_response

OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes of orchestrators and load balancers
OWNER_KEY = "api_owner"  # request.state.api_owner: which key sent the request (None: no auth)


async def send_error(scope: Any, receive: Any, send: Any, status: int, code: str,
                     message: str, field: str | None,
                     headers: dict[str, str] | None = None) -> None:
    """Answer with the verifier's usual error body (``errors.error_response``)."""
    response = error_response(status, code, message, field)
    response.headers.update(headers or {})
    await response(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeyAuth:
    """Every path but the probes needs one of the configured keys, sent as
    ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``; otherwise 401.

    Keys are compared as SHA-256 digests with ``hmac.compare_digest``, against every key without
    stopping at a match, so the time taken says nothing about how much of a key was right.
    Sessions belong to the key that opened them (``request.state.api_owner``)."""

    def __init__(self, app: Any, keys: list[str]) -> None:
        self.app = app
        self.keys = [(_digest(key), f"key-{_digest(key).hex()[:8]}") for key in keys]

    def owner_of(self, presented: str | None) -> str | None:
        if presented is None:
            return None
        digest, owner = _digest(presented), None
        for known, name in self.keys:
            if hmac.compare_digest(digest, known):
                owner = name
        return owner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        presented = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        if presented is None and b"x-api-key" in headers:
            presented = headers[b"x-api-key"].decode("latin-1").strip()
        owner = self.owner_of(presented)
        if owner is None and scope.get("path") not in OPEN_PATHS:
            why = "no API key was sent" if presented is None else "the API key is not valid"
            await send_error(scope, receive, send, 401, "unauthorized", f"{why}: send "
                             "'Authorization: Bearer KEY' (the client's --api-key or "
                             "SPECDEC_API_KEY)", "authorization",
                             {"www-authenticate": 'Bearer realm="specdec"'})
            return
        scope = {**scope, "state": {**scope.get("state", {}), OWNER_KEY: owner}}
        await self.app(scope, receive, send)


def verifier_body_limit(app: Any, max_bytes: int, timeout_s: float) -> BodyLimit:
    """``shared.http.body_limit.BodyLimit`` answering in the verifier's error shape."""
    return BodyLimit(app, max_bytes, lambda status, code, message: error_response(
        status, code, message, "body"), timeout_s, "SPECDEC_MAX_BODY_BYTES",
        "SPECDEC_BODY_TIMEOUT_S")


class ShutdownAnswer:
    """When the shutdown grace period runs out, uvicorn cancels the calls still in flight; a call
    that has not answered yet then gets a retryable 503 with Retry-After (a client retries it,
    behind a balancer on another replica) instead of a plain-text 500."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not started:
                with contextlib.suppress(Exception):
                    await send_error(scope, receive, send, 503, "shutting_down", "the verifier "
                                     "is shutting down; retry", None,
                                     {"retry-after": "1", "connection": "close"})
            raise
