"""Fixtures: tiny models built from a config, and verifiers serving them (tests/support/)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import torch

from drafter_client.api import SpecDecClient
from drafter_client.gateway import GatewaySettings, create_gateway, server_options
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.ordering import worker_order
from tests.support.servers import ThreadedServer
from tests.support.tiny_models import build_tiny_set
from verifier_service.settings import Settings

# One intra-op thread per test process, and per server it starts: pytest-xdist runs a worker on
# every core, and two OpenMP teams per core spin against each other while the tiny models gain
# nothing from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest work first on every worker (tests/support/ordering.py)."""
    items[:] = worker_order(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(scope="session", autouse=True)
def dtype_choices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``--dtype auto`` records its measured choices for the tests' tiny models, llama.cpp's
    AMX probe its findings and the verifiers their verify costs, in the session's temporary
    folder, not in the user's $SPECDEC_HOME
    (subprocesses inherit it)."""
    folder = tmp_path_factory.mktemp("dtype")
    names = {"SPECDEC_DTYPE_CACHE": folder / "choices.json",
             "SPECDEC_LLAMA_AMX_CACHE": folder / "llama-cpp-amx.json",
             "SPECDEC_VERIFY_COSTS": folder / "verify-costs.json"}
    previous = {name: os.environ.get(name) for name in names}
    os.environ.update({name: str(path) for name, path in names.items()})
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Local checkpoint folders (see ``build_tiny_set``)."""
    return build_tiny_set(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def q4k(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Q4_K_M target and drafter quantized by llama.cpp (``save_quantized_gguf``: seconds of
    CPU each), built once per session."""
    from tests.support.tiny_gguf import save_quantized_gguf

    root = tmp_path_factory.mktemp("q4k")
    return {"target": save_quantized_gguf(root / "target", seed=0),
            "drafter": save_quantized_gguf(root / "drafter", seed=1)}


@pytest.fixture(scope="session")
def gpt2_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(fp32_settings(tiny_models["gpt2-target"], max_draft_tokens=8)) as server:
        yield server


@pytest.fixture(scope="session")
def llama_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(fp32_settings(tiny_models["llama-target"], max_draft_tokens=8,
                                  max_context=64)) as server:
        yield server


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    """The settings of the module's ``server``: the tiny GPT-2 target in float32. A module that
    needs others overrides this fixture; one with ``params`` gets a server per parameter."""
    return fp32_settings(tiny_models["gpt2-target"], max_draft_tokens=8)


@pytest.fixture(scope="module")
def server(server_settings: Settings) -> Iterator[LiveServer]:
    """The module's own verifier, on ``server_settings`` (its counters and sessions are the
    module's alone, unlike the session's ``gpt2_server`` and ``llama_server``)."""
    with LiveServer(server_settings) as live:
        yield live


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[[Settings], LiveServer]]:
    """``start_server(settings)``: a further verifier for the module, beside its ``server``;
    each stops after the module's last test."""
    with contextlib.ExitStack() as started:
        yield lambda settings: started.enter_context(LiveServer(settings))


@pytest.fixture(scope="module")
def gateway_client(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    """The client behind the module's ``gateway``: the GPT-2 pair. A module overrides it."""
    return SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-drafter"]))


@pytest.fixture(scope="module")
def gateway_settings() -> GatewaySettings:
    """The settings of the module's ``gateway``: 'tiny-gpt2'. A module overrides them."""
    return GatewaySettings("tiny-gpt2")


@pytest.fixture(scope="module")
def oai(gateway: ThreadedServer) -> openai.OpenAI:
    """The official ``openai`` client on the module's ``gateway``."""
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def gateway(gateway_client: SpecDecClient,
            gateway_settings: GatewaySettings) -> Iterator[ThreadedServer]:
    """``specdec serve`` for ``gateway_client`` and ``gateway_settings`` (with its uvicorn
    options, as ``specdec serve`` runs it), one per test module; ``gateway.app.state.gateway``
    is its engine."""
    app = create_gateway(gateway_client, gateway_settings)
    with ThreadedServer(app, **server_options(gateway_settings)) as server:
        yield server
