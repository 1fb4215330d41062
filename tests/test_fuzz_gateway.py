"""Schemathesis against the gateway's own OpenAPI schema (``specdec serve``): no generated
request may get a 5xx or a traceback, and the gateway serves normally afterwards.

Like ``test_fuzz.py`` for the verifier: every operation gets up to ``EXAMPLES`` cases that follow
the schema (the request models ``parse_request`` validates against) and up to as many that break
it, sent over HTTP to a live gateway in front of a live verifier on the tiny pair, with the
gateway's API key on.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from drafter_client.api import SpecDecClient
from drafter_client.gateway import GatewaySettings
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.servers import ThreadedServer
from verifier_service.settings import Settings

pytestmark = pytest.mark.fuzz
KEY = "gateway-fuzz-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny-gpt2"
EXAMPLES = 60


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models["gpt2-target"], max_new_tokens=8, max_draft_tokens=4,
                         max_context=64, kv_budget_tokens=64 * 8, max_sessions=8)


@pytest.fixture(scope="module")
def gateway_client(server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]), dtype="float32")


@pytest.fixture(scope="module")
def gateway_settings() -> GatewaySettings:
    return GatewaySettings(MODEL, api_key=KEY, max_body_bytes=65536, completion_max_tokens=4)


def fuzz(url: str, api_schema: Any, mode: GenerationMode) -> tuple[Counter[str], Counter[int]]:
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    refusals: Counter[str] = Counter()
    for operation in [result.ok() for result in api_schema.get_all_operations()]:
        if operation.path == "/metrics":
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            response = case.call(base_url=url, headers=AUTH, timeout=60)
            cases[f"{case.method} {case.path}"] += 1
            statuses[response.status_code] += 1
            if response.status_code == 400:
                refusals[response.json()["error"]["param"]] += 1
            assert response.status_code < 500, (case.method, case.formatted_path, case.body,
                                                response.text)
            assert "Traceback" not in response.text
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        try:
            call()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to break
    print(f"\n400s by param: {dict(refusals.most_common(12))}")
    return cases, statuses


@pytest.mark.parametrize(("mode", "min_cases"), [(GenerationMode.POSITIVE, 150),
                                                 (GenerationMode.NEGATIVE, 80)])
def test_no_server_errors_and_the_gateway_survives(gateway: ThreadedServer,
                                                   mode: GenerationMode, min_cases: int,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json", headers=AUTH).json()  # behind the key
    assert "CompletionRequest" in document["components"]["schemas"]
    with caplog.at_level(logging.ERROR):
        cases, statuses = fuzz(gateway.url, schemathesis.openapi.from_dict(document), mode)
    print(f"\nschemathesis {mode.value} (gateway): {sum(cases.values())} cases over "
          f"{len(cases)} operations; statuses {dict(sorted(statuses.items()))}")
    posts = [op for op in cases if op.startswith("POST")]
    assert len(posts) == 2 and sum(cases.values()) >= min_cases, cases
    assert not [s for s in statuses if s >= 500]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    reply = oai.completions.create(model=MODEL, prompt="the cat", temperature=0, max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
