"""Real uvicorn servers (the verifier, the gateway) on loopback ports, in threads of the test
process."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from tests.support.process import free_port
from verifier_service.app import create_app, server_options
from verifier_service.engine import Engine
from verifier_service.settings import Settings

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


class LiveServer(ThreadedServer):
    """The verifier for these settings (``engine``: an already loaded target to share)."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        super().__init__(create_app(settings, engine), **server_options(settings))


def fp32_settings(model: Path, **overrides: object) -> Settings:
    return Settings(model=str(model), dtype="float32", device="cpu", **overrides)  # type: ignore[arg-type]


