"""HTTP transport to the verifier: orjson bodies, typed responses, byte counters, clear errors."""

from __future__ import annotations

import random
import secrets
import time
from typing import Protocol, TypeVar

import httpx
import orjson
from pydantic import BaseModel, ValidationError

from drafter_client.errors import SpecDecError, checked_url
from drafter_client.settings import DEFAULTS
from shared.http.auth import bearer_header
from shared.protocol.schema import (
    AFFINITY_HEADER,
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


class VerifierHTTPError(SpecDecError):
    def __init__(self, status: int, code: str, message: str, field: str | None,
                 position: int | None = None) -> None:
        super().__init__(f"verifier answered {status} ({code}): {message}")
        self.status, self.code, self.field, self.position = status, code, field, position


class VerifierUnavailable(SpecDecError):
    """The verifier stayed unreachable or overloaded for the whole retry budget."""


class Verifier(Protocol):
    """What the client needs from a verifier: :class:`HttpVerifier` over HTTP, or anything with
    the same calls (the tests' in-process verifier). Counters feed the generation metrics."""

    bytes_sent: int
    bytes_received: int
    retries: int
    simulated_rtt_s: float

    def info(self, budget_s: float | None = None) -> InfoResponse: ...

    def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse: ...

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResponse: ...

    def delete_session(self, session_id: str, budget_s: float = 2.0) -> None: ...

    def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    def close(self) -> None: ...


RETRY_STATUSES = frozenset({429, 502, 503, 504})  # overloaded, or a proxy without a backend


def retry_delay(retry_after: str | None, attempt: int, max_delay_s: float = 2.0) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): Retry-After when given, else
    exponential backoff from 0.1 s up to ``max_delay_s``; jittered by up to +50% so clients do
    not retry in step."""
    try:
        base = float(retry_after) if retry_after is not None else 0.1 * 2**attempt
    except ValueError:
        base = 0.1 * 2**attempt
    if retry_after is None:
        base = min(base, max_delay_s)
    return min(base, 30.0) * (1 + 0.5 * random.random())


def _is_name_error(exc: Exception) -> bool:
    """A host name that does not resolve will not start resolving by retrying."""
    text = str(exc).lower()
    return "name or service not known" in text or "nodename nor servname" in text


class HttpVerifier:
    """Talks to one verifier. Pass ``client`` to reuse an httpx.Client (or a TestClient).

    The session calls are safe to repeat (verify names its step, sessions are created under an
    id we choose), so connection errors, timeouts, 429 and 502/503/504 are retried with jittered
    exponential backoff (Retry-After when the verifier sends one) until ``retry_budget_s`` has
    passed since the call's first failure. ``/v1/generate`` is not: a timeout or a proxy's
    502/504 may leave the first run going, so it is retried only where the verifier cannot have
    started it (the connection refused, or 429/503: turned away)."""

    def __init__(self, url: str, timeout_s: float = DEFAULTS.timeout_s,
                 client: httpx.Client | None = None, simulated_rtt_s: float = 0.0,
                 retry_budget_s: float = DEFAULTS.retry_budget_s,
                 api_key: str | None = None) -> None:
        self.url = checked_url(url)
        self.simulated_rtt_s = simulated_rtt_s  # added before each call, to study distance
        self.retry_budget_s = retry_budget_s
        self.retries = 0
        if api_key and not (api_key.isascii() and api_key.isprintable()):
            raise SpecDecError("the API key must be printable ASCII (check --api-key / "
                               "SPECDEC_API_KEY)")
        self.owns_client = client is None  # a client passed in is closed by its owner
        self.client = client or httpx.Client(base_url=self.url, timeout=timeout_s)
        self.api_key = api_key
        self.auth = bearer_header(api_key) if api_key else {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.affinity: dict[str, str] = {}  # session id -> the router's AFFINITY_HEADER

    def _call(self, method: str, path: str, body: BaseModel | None,
              response_model: type[M] | None, session_id: str | None = None,
              budget_s: float | None = None, repeatable: bool = True) -> M | None:
        content = orjson.dumps(body.model_dump()) if body is not None else None
        headers = {"content-type": "application/json", **self.auth} if content else {**self.auth}
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
            if session_id in self.affinity:
                headers[AFFINITY_HEADER] = self.affinity[session_id]
        budget = self.retry_budget_s if budget_s is None else budget_s
        first_failure: float | None = None
        attempt = 0
        while True:
            if self.simulated_rtt_s:
                time.sleep(self.simulated_rtt_s)
            retry_after, why = None, ""
            try:
                response = self.client.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                if _is_name_error(exc):
                    raise SpecDecError(f"cannot reach the verifier at {self.url}: {exc}") from exc
                if not repeatable and not isinstance(exc, httpx.ConnectError):
                    raise SpecDecError(f"{method} {path} to {self.url} failed after it was "
                                       f"sent ({type(exc).__name__}: {exc}); not repeated, "
                                       "since the verifier may still be running it") from exc
                why = f"{type(exc).__name__}: {exc}"
            else:
                self.bytes_sent += len(content or b"")
                self.bytes_received += len(response.content)
                token = response.headers.get(AFFINITY_HEADER)
                if session_id is not None and token:
                    self.affinity[session_id] = token
                turned_away = response.status_code in (429, 503)
                if response.status_code not in RETRY_STATUSES or not (repeatable or turned_away):
                    break
                retry_after = response.headers.get("retry-after")
                why = f"HTTP {response.status_code}"
            now = time.monotonic()
            first_failure = first_failure if first_failure is not None else now
            delay = retry_delay(retry_after, attempt)
            if now + delay - first_failure > budget:
                raise VerifierUnavailable(
                    f"cannot reach the verifier at {self.url} ({method} {path}): no answer "
                    f"for {now - first_failure:.1f} s over {attempt + 1} attempts (last: "
                    f"{why}); retry budget {budget:g} s")
            self.retries += 1
            attempt += 1
            time.sleep(delay)
        if response.status_code >= 400:
            try:
                error = orjson.loads(response.content)["error"]
                code, message = error["code"], error["message"]
                field, position = error.get("field"), error.get("position")
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise VerifierHTTPError(response.status_code, "http_error",
                                        response.text[:200].replace("\n", " "), None) from None
            if response.status_code == 401:
                message += " - check --api-key / SPECDEC_API_KEY"
            raise VerifierHTTPError(response.status_code, code, message, field, position)
        if response_model is None:
            return None
        try:
            return response_model.model_validate_json(response.content)
        except ValidationError as exc:
            raise SpecDecError(f"{self.url}{path} answered something that is not a specdec "
                               f"verifier response: {exc.errors()[0]['msg']}") from exc

    def info(self, budget_s: float | None = None) -> InfoResponse:
        return self._call("GET", "/v1/info", None, InfoResponse,  # type: ignore[return-value]
                          budget_s=budget_s)

    def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse:
        """Opens a session under an id we choose, so a balancer can route every call by it."""
        if req.session_id is None:
            req = req.model_copy(update={"session_id": secrets.token_urlsafe(12)})
        self.affinity.pop(req.session_id or "", None)  # a reopen: the router places it afresh
        return self._call("POST", "/v1/sessions", req,  # type: ignore[return-value]
                          CreateSessionResponse, req.session_id)

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResponse:
        return self._call("POST", f"/v1/sessions/{session_id}/verify",  # type: ignore[return-value]
                          req, VerifyResponse, session_id)

    def delete_session(self, session_id: str, budget_s: float = 2.0) -> None:
        """Best effort with a short budget: an unused session expires on the verifier anyway."""
        try:
            self._call("DELETE", f"/v1/sessions/{session_id}", None, None, session_id,
                       budget_s=budget_s)
        finally:
            self.affinity.pop(session_id, None)

    def generate(self, req: GenerateRequest) -> GenerateResponse:
        return self._call("POST", "/v1/generate", req,  # type: ignore[return-value]
                          GenerateResponse, repeatable=False)

    def clone(self) -> HttpVerifier:
        """The same verifier over the same connection pool, with its own counters (one per
        concurrent generation, so each one's metrics are its own)."""
        return HttpVerifier(self.url, client=self.client, simulated_rtt_s=self.simulated_rtt_s,
                            retry_budget_s=self.retry_budget_s, api_key=self.api_key)

    def close(self) -> None:
        if self.owns_client:
            self.client.close()
