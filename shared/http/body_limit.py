"""A pure ASGI middleware that bounds request bodies, shared by the verifier and the gateway.

A body over ``max_bytes`` gets 413, by its Content-Length before anything is read or, for a
chunked body, as soon as the bytes read pass the limit; a body that has not fully arrived
``timeout_s`` after reading began gets 408 and the connection is closed (a stalled body pins
memory). The app then gets the whole body, buffered once. Each side answers in its own error
shape through ``reject``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

# (status, code, message) -> the side's error answer
Reject = Callable[[int, str, str], Response]


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int, reject: Reject, timeout_s: float,
                 limit_name: str = "max_body_bytes", timeout_name: str = "body_timeout_s"
                 ) -> None:
        self.app, self.max_bytes, self.reject, self.timeout_s = app, max_bytes, reject, timeout_s
        self.limit_name, self.timeout_name = limit_name, timeout_name

    async def _answer(self, scope: Any, receive: Any, send: Any, status: int, code: str,
                      message: str, headers: dict[str, str] | None = None) -> None:
        response = self.reject(status, code, message)
        response.headers.update(headers or {})
        await response(scope, receive, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "DELETE"):
            await self.app(scope, receive, send)
            return
        too_big = (f"the request body is larger than the limit of {self.max_bytes} bytes "
                   f"({self.limit_name})")
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._answer(scope, receive, send, 413, "body_too_large", too_big)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                chunks.clear()
                await self._answer(scope, receive, send, 408, "request_timeout", "the request "
                                   f"body did not arrive within {self.timeout_s:g} s "
                                   f"({self.timeout_name})", {"connection": "close"})
                return
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                chunks.clear()
                await self._answer(scope, receive, send, 413, "body_too_large", too_big)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                body = b"".join(chunks)
                chunks.clear()
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
