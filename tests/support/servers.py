"""Any ASGI app (the verifier, the gateway) on a real uvicorn server on a loopback port, in a
thread of this process."""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import uvicorn

from tests.support.waiting import wait_until
from verifier_service.launch import free_port

S = TypeVar("S", bound="ThreadedServer")


class ThreadedServer:
    """Any ASGI app on a real uvicorn server on a loopback port, in a thread of the test
    process."""

    def __init__(self, app: Any, **options: Any) -> None:
        self.app = app
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self: S) -> S:
        self.thread.start()

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("the server's thread ended before it started")
            return bool(self.server.started)

        wait_until(started, timeout_s=60, what="the server's start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
