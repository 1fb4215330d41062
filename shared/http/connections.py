"""Connection-level limits that uvicorn does not enforce by itself, for both servers (the
verifier and the gateway, each answering in its own error shape).

uvicorn closes a keep-alive connection that stays idle after a response, but waits forever for
the first request head of a connection, and for a request head sent a byte at a time (slowloris).
:class:`GuardedH11Protocol` gives every request head a deadline: a connection that has not sent a
complete head within ``header_timeout_s`` of connecting (or of its previous response) gets a 408
in the server's error shape and is closed. Bodies have their own deadline (``guards.BodyLimit``).

Connections are bounded by ``max_connections``. uvicorn's own bound answers 503 to every new
request while it is reached, which lets idle connections lock real clients out; here a new
connection beyond the bound instead closes the connection that has waited longest for a request
head (408), so clients that send requests keep being served. Only when every connection is busy
with a request does the newcomer get 503.

Two HTTP parsers carry the same guards: httptools (C, the default where it is installed: less
Python per call than h11, ``python -m scripts.bench calls``) and h11 (pure Python).
h11 bounds a request head at 16 KiB by itself; with httptools the guard counts the bytes of a
head that has not completed and answers 431 beyond the same bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11 serves
    HttpToolsProtocol = None  # type: ignore[misc,assignment]  # h11 serves

MAX_HEAD_BYTES = 16 * 1024  # h11's (and uvicorn's) bound on an incomplete request head

# (status, code, message) -> the JSON body of the server's error answer
from shared.http.limits import HTTP_LIMITS  # noqa: E402

ErrorBody = Callable[[int, str, str], bytes]


def verifier_error_body(status: int, code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message, "field": None}})


class HeadGuard:
    """The guards, mixed into one of uvicorn's protocol classes (which supplies ``cycle``,
    ``transport``, ``loop`` and ``connections``)."""

    header_timeout_s = HTTP_LIMITS.header_timeout_s
    max_connections = 0  # 0: no bound
    timeout_name = "SPECDEC_HEADER_TIMEOUT_S"  # the setting named in a timeout's message
    error_body: ErrorBody = staticmethod(verifier_error_body)
    _head_timer: asyncio.TimerHandle | None = None
    _waiting_since = 0.0  # when it started waiting for a request head
    cycle: Any
    transport: Any
    loop: Any
    connections: Any

    @classmethod
    def configured(cls, header_timeout_s: float, max_connections: int = 0,
                   error_body: ErrorBody = verifier_error_body,
                   timeout_name: str = "SPECDEC_HEADER_TIMEOUT_S") -> type[Any]:
        return type(cls.__name__, (cls,), {"header_timeout_s": header_timeout_s,
                                           "max_connections": max_connections,
                                           "error_body": staticmethod(error_body),
                                           "timeout_name": timeout_name})

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()
        if self.max_connections and len(self.connections) > self.max_connections:
            waiting = [c for c in self.connections if isinstance(c, HeadGuard)
                       and c is not self and c._head_timer is not None]
            if waiting:
                min(waiting, key=lambda c: c._waiting_since)._reject(
                    408, "request_timeout", "closed to make room for a new connection: it "
                    "waited longest for a request head")
            else:
                self._reject(503, "too_many_connections", f"the server holds "
                             f"{self.max_connections} busy connections "
                             "(SPECDEC_MAX_CONNECTIONS); retry shortly", retry_after=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm()  # the next head on this keep-alive connection has a deadline too

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = time.monotonic()  # not loop.time(): uvloop's is per iteration
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served
        self._reject(408, "request_timeout", f"no complete request head within "
                     f"{self.header_timeout_s:g} s ({self.timeout_name})")

    def _reject(self, status: int, code: str, message: str, retry_after: bool = False) -> None:
        """Answer with the verifier's error shape and close, outside any request cycle."""
        self._disarm()
        if self.transport.is_closing():
            return
        body = self.error_body(status, code, message)
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}.get(
            status, b"Service Unavailable")
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\n%scontent-length: %d\r\n\r\n"
                             % (status, reason, b"retry-after: 1\r\n" if retry_after else b"",
                                len(body)) + body)
        self.transport.close()


class GuardedH11Protocol(HeadGuard, H11Protocol):
    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a complete request head arrived
            self._disarm()


if HttpToolsProtocol is not None:
    class GuardedHttpToolsProtocol(HeadGuard, HttpToolsProtocol):  # type: ignore[misc,valid-type]
        _head_bytes = 0
        # from a head's end to its message's end: bytes arriving then are a body's, even after
        # the answer (a 413 sent on the Content-Length alone, the body still coming), never
        # the next head's
        _in_body = False

        def data_received(self, data: bytes) -> None:
            waiting = self._head_timer is not None and not self._in_body
            if waiting:
                self._head_bytes += len(data)
            super().data_received(data)
            if waiting and self._head_timer is not None and self._head_bytes > MAX_HEAD_BYTES:
                self._reject(431, "request_header_too_large", f"the request head is larger "
                             f"than {MAX_HEAD_BYTES} bytes")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._disarm()
            self._in_body = True

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_body = False

        def _arm(self) -> None:
            super()._arm()
            self._head_bytes = 0


def guarded_protocol(parser: str, header_timeout_s: float, max_connections: int,
                     error_body: ErrorBody = verifier_error_body,
                     timeout_name: str = "SPECDEC_HEADER_TIMEOUT_S") -> type[Any]:
    """uvicorn's ``http`` option: the guarded protocol for ``parser`` ("auto": httptools where
    it is installed, else h11)."""
    options = (header_timeout_s, max_connections, error_body, timeout_name)
    if parser != "h11" and HttpToolsProtocol is not None:
        return GuardedHttpToolsProtocol.configured(*options)
    if parser == "httptools":
        raise RuntimeError("--http-parser httptools: httptools is not installed")
    return GuardedH11Protocol.configured(*options)


async def disconnected(request: Any) -> None:
    """Returns when the HTTP client hangs up: call it once the request's body is read, when what
    arrives next on the connection is its end (a Starlette ``Request``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
