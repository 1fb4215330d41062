"""HTTP request metrics for Prometheus, shared by the verifier and the gateway: a pure ASGI
middleware that counts every answer by method, route template and status, times it, and counts
error answers by the code in their JSON error body (the verifier's ``error.code``, OpenAI's
``error.code`` or ``error.type``)."""

from __future__ import annotations

import re
import time
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)


class HttpMetrics:
    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.requests = Counter(f"{prefix}_requests", "HTTP requests answered, by route "
                                "template and status", ["method", "route", "status"],
                                registry=registry)
        self.errors = Counter(f"{prefix}_errors", "Error answers (4xx / 5xx) by status and error "
                              "code (e.g. 429 overloaded, 503 busy)", ["status", "code"],
                              registry=registry)
        self.seconds = Histogram(f"{prefix}_request_duration_seconds", "Time from the request's "
                                 "start to the end of its answer, by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=registry)


class RequestMetrics:
    """Pure ASGI middleware; add it outermost so it sees every answer, the guards' too. Routes
    are labelled by template (``/v1/sessions/{session_id}/verify``), unknown paths ``other``, so
    label values stay bounded."""

    def __init__(self, app: Any, metrics: HttpMetrics, routes: list[tuple[str, str]]) -> None:
        self.app, self.metrics = app, metrics
        self.routes = [(re.compile(regex), template) for regex, template in routes]
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def route_of(self, path: str) -> str:
        for regex, template in self.routes:
            if regex.fullmatch(path):
                return template
        return "other"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, body = 500, bytearray()

        async def observe(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < 4096:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            route = self.route_of(scope.get("path", ""))
            m = self.metrics
            key = (scope.get("method", ""), route, status)
            children = self._children.get(key)
            if children is None:  # labels() once per (method, route, status), not per call
                children = self._children[key] = (m.requests.labels(key[0], route, str(status)),
                                                  m.seconds.labels(route))
            children[0].inc()
            children[1].observe(time.perf_counter() - started)
            if status >= 400:
                m.errors.labels(str(status), error_code(bytes(body))).inc()


def error_code(body: bytes) -> str:
    try:
        error = orjson.loads(body)["error"]
        code = error.get("code") or error.get("type")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return "unknown"
    return code if isinstance(code, str) and len(code) <= 64 else "unknown"
