"""One thread runs all of a verifier's model work: the CLI loads and warms the target on the
thread that then serves every forward (verifier_service/state.py: ModelThread says why)."""

from __future__ import annotations

import threading
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.engines.transformers.target import CausalEngine
from tests.support.live_server import fp32_settings
from tests.support.servers import ThreadedServer
from verifier_service import cli
from verifier_service.app import create_app, server_options
from verifier_service.settings import load_engine
from verifier_service.state import ModelThread


def test_cli_loads_the_target_on_the_thread_it_serves_from(
        monkeypatch: pytest.MonkeyPatch, tiny_models: dict[str, Path]) -> None:
    loaded_on: list[int] = []
    served: list[ModelThread] = []

    class Loaded:  # served through its engine's process hook (none for transformers)
        info = types.SimpleNamespace(engine="transformers")

    def load(settings: Any) -> Loaded:
        loaded_on.append(threading.get_ident())
        return Loaded()

    monkeypatch.setattr(cli, "load_target", load)
    monkeypatch.setattr(cli, "serve", lambda settings, runner, thread: served.append(thread))
    cli.main(["--model", str(tiny_models["llama-target"]), "--device", "cpu"])
    assert len(loaded_on) == 1 and len(served) == 1
    assert loaded_on[0] != threading.get_ident()
    assert served[0].call(threading.get_ident) == loaded_on[0]


def test_every_forward_runs_on_the_given_model_thread(tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["llama-target"], max_context=64)
    thread = ModelThread()
    runner = thread.call(load_engine, settings)
    assert isinstance(runner, CausalEngine)
    loader = thread.call(threading.get_ident)
    seen: list[int] = []
    forward = runner.forward

    def recording(items: Any) -> Any:
        seen.append(threading.get_ident())
        return forward(items)

    runner.forward = recording  # type: ignore[method-assign]
    app = create_app(settings, runner, thread)
    with ThreadedServer(app, **server_options(settings)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        reply = http.post("/v1/generate", json={"prompt_ids": [2, 3, 4], "max_new_tokens": 4,
                                                "stop_at_eos": False})
        assert reply.status_code == 200, reply.text
        assert app.state.verifier.model_thread is thread
    assert len(seen) >= 4 and set(seen) == {loader}
