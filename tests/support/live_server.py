"""A real uvicorn verifier on a loopback port, in a thread of the test process."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn

from tests.support.process import free_port
from verifier_service.app import create_app, server_options
from verifier_service.settings import Settings
from verifier_service.target import TargetRunner


class LiveServer:
    """A real uvicorn server on a loopback port, in a thread of the test process."""

    def __init__(self, settings: Settings, runner: TargetRunner | None = None) -> None:
        self.port = free_port()
        config = uvicorn.Config(create_app(settings, runner), host="127.0.0.1", port=self.port,
                                log_level="warning", **server_options(settings))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("verifier did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def fp32_settings(model: Path, **overrides: object) -> Settings:
    return Settings(model=str(model), dtype="float32", device="cpu", **overrides)  # type: ignore[arg-type]


