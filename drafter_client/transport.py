"""HTTP transport to the verifier: orjson bodies, typed responses, byte counters, clear errors."""

from __future__ import annotations

import random
import secrets
import time
from typing import TypeVar

import httpx
import orjson
from pydantic import BaseModel, ValidationError

from shared.schema import (
    SESSION_HEADER,
    CreateSessionRequest,
    CreateSessionResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
)

M = TypeVar("M", bound=BaseModel)


class SpecDecError(RuntimeError):
    """An error the client cannot recover from; the message is one line for the user."""


class VerifierHTTPError(SpecDecError):
    def __init__(self, status: int, code: str, message: str, field: str | None) -> None:
        super().__init__(f"verifier answered {status} ({code}): {message}")
        self.status, self.code, self.field = status, code, field


def retry_delay(retry_after: str | None, attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): Retry-After when given, else
    exponential backoff from 0.1 s; jittered by up to +50% so clients do not retry in step."""
    try:
        base = float(retry_after) if retry_after is not None else 0.1 * 2**attempt
    except ValueError:
        base = 0.1 * 2**attempt
    return min(base, 30.0) * (1 + 0.5 * random.random())


class HttpVerifier:
    """Talks to one verifier. Pass ``client`` to reuse an httpx.Client (or a TestClient)."""

    def __init__(self, url: str, timeout_s: float = 120.0,
                 client: httpx.Client | None = None, simulated_rtt_s: float = 0.0,
                 max_retries: int = 8) -> None:
        self.url = url.rstrip("/")
        self.simulated_rtt_s = simulated_rtt_s  # added before each call, to study distance
        self.max_retries = max_retries  # for 429 / 503 answers
        self.retries = 0
        self.client = client or httpx.Client(base_url=self.url, timeout=timeout_s)
        self.bytes_sent = 0
        self.bytes_received = 0

    def _call(self, method: str, path: str, body: BaseModel | None,
              response_model: type[M] | None, session_id: str | None = None) -> M | None:
        content = orjson.dumps(body.model_dump()) if body is not None else None
        headers = {"content-type": "application/json"} if content else {}
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
        for attempt in range(self.max_retries + 1):
            if self.simulated_rtt_s:
                time.sleep(self.simulated_rtt_s)
            try:
                response = self.client.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                raise SpecDecError(f"cannot reach the verifier at {self.url}{path}: "
                                   f"{exc}") from exc
            self.bytes_sent += len(content or b"")
            self.bytes_received += len(response.content)
            if response.status_code not in (429, 503) or attempt == self.max_retries:
                break
            # Overloaded: wait as told (Retry-After), with jitter, then try again.
            self.retries += 1
            time.sleep(retry_delay(response.headers.get("retry-after"), attempt))
        if response.status_code >= 400:
            try:
                error = orjson.loads(response.content)["error"]
                raise VerifierHTTPError(response.status_code, error["code"], error["message"],
                                        error.get("field"))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise VerifierHTTPError(response.status_code, "http_error",
                                        response.text[:200], None) from None
        if response_model is None:
            return None
        try:
            return response_model.model_validate_json(response.content)
        except ValidationError as exc:
            raise SpecDecError(f"{self.url}{path} answered something that is not a specdec "
                               f"verifier response: {exc.errors()[0]['msg']}") from exc

    def info(self) -> InfoResponse:
        return self._call("GET", "/v1/info", None, InfoResponse)  # type: ignore[return-value]

    def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse:
        """Opens a session under an id we choose, so a balancer can route every call by it."""
        if req.session_id is None:
            req = req.model_copy(update={"session_id": secrets.token_urlsafe(12)})
        return self._call("POST", "/v1/sessions", req,  # type: ignore[return-value]
                          CreateSessionResponse, req.session_id)

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResponse:
        return self._call("POST", f"/v1/sessions/{session_id}/verify",  # type: ignore[return-value]
                          req, VerifyResponse, session_id)

    def delete_session(self, session_id: str) -> None:
        self._call("DELETE", f"/v1/sessions/{session_id}", None, None, session_id)

    def generate(self, req: GenerateRequest) -> GenerateResponse:
        return self._call("POST", "/v1/generate", req,  # type: ignore[return-value]
                          GenerateResponse)

    def close(self) -> None:
        self.client.close()
