"""The verifier on a real uvicorn server on a loopback port, in a thread of the test process."""

from __future__ import annotations

from pathlib import Path

from shared.engines.target import Engine
from tests.support.servers import ThreadedServer
from verifier_service.app import create_app, server_options
from verifier_service.settings import Settings


class LiveServer(ThreadedServer):
    """The verifier for these settings (``engine``: an already loaded target to share)."""

    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        super().__init__(create_app(settings, engine), **server_options(settings))


def fp32_settings(model: Path, **overrides: object) -> Settings:
    return Settings(model=str(model), dtype="float32", device="cpu", **overrides)  # type: ignore[arg-type]


