"""Any ASGI app (the verifier, the gateway) on a real uvicorn server on a loopback port, in a
thread of this process."""

from __future__ import annotations

import threading
import time
from typing import Any, TypeVar

import uvicorn

from verifier_service.launch import free_port

S = TypeVar("S", bound="ThreadedServer")


class ThreadedServer:
    """Any ASGI app on a real uvicorn server on a loopback port, in a thread of the test
    process."""

    def __init__(self, app: Any, **options: Any) -> None:
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
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
