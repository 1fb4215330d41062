"""Connection-level limits that uvicorn does not enforce by itself.

uvicorn closes a keep-alive connection that stays idle after a response, but waits forever for
the first request head of a connection, and for a request head sent a byte at a time (slowloris).
:class:`GuardedH11Protocol` gives every request head a deadline: a connection that has not sent a
complete head within ``header_timeout_s`` of connecting (or of its previous response) gets a 408
in the verifier's error shape and is closed. Bodies have their own deadline (``guards.BodyLimit``)
and the number of connections is bounded by uvicorn's ``limit_concurrency`` (503 beyond it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, header_timeout_s: float) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"header_timeout_s": header_timeout_s})

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a complete request head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next head on this keep-alive connection has a deadline too

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served
        body = orjson.dumps({"error": {
            "code": "request_timeout", "field": None,
            "message": f"no complete request head within {self.header_timeout_s:g} s "
                       "(SPECDEC_HEADER_TIMEOUT_S)"}})
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                             b"\r\nconnection: close\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()
