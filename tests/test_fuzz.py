"""Schemathesis against the verifier's own OpenAPI schema: no generated request may get a 5xx.

Every operation gets up to ``EXAMPLES`` generated cases that follow the schema and up to as many
that break it (wrong types, missing fields, odd path parameters), sent over HTTP to a live
verifier with a tiny model and API keys on; each test then checks how many cases ran and that
the verifier still serves correctly afterwards, so either runs alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.live_server import LiveServer, fp32_settings

pytestmark = pytest.mark.fuzz
KEY = "fuzz-key-0001"
AUTH = {"authorization": f"Bearer {KEY}"}
EXAMPLES = 100


@pytest.fixture(scope="module")
def fuzz_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    limits = fp32_settings(tiny_models["gpt2-target"], api_keys=KEY, max_new_tokens=8,
                           max_draft_tokens=4, max_context=64, kv_budget_tokens=64 * 8,
                           max_sessions=8, max_body_bytes=65536)
    with LiveServer(limits) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer) -> Any:
    document = httpx.get(f"{fuzz_server.url}/openapi.json", headers=AUTH).json()
    return schemathesis.openapi.from_dict(document)


# schemathesis' pytest plugin does not run on pytest 9, so its strategies drive hypothesis here.
def fuzz(url: str, api_schema: Any, mode: GenerationMode) -> tuple[Counter[str], Counter[int],
                                                                   list[str]]:
    """Every operation's generated cases in ``mode``: (cases per operation, statuses,
    operations with nothing to break)."""
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    no_negative: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to break: no parameters, no body

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            response = case.call(base_url=url, headers=AUTH, timeout=30)
            cases[f"{case.method} {case.path}"] += 1
            statuses[response.status_code] += 1
            assert response.status_code < 500, (case.method, case.formatted_path, case.body,
                                                response.text)

        try:
            call()
        except Unsatisfiable:
            # e.g. DELETE /v1/sessions/{session_id}: any string is a valid id, nothing to break
            assert mode is GenerationMode.NEGATIVE, operation.label
            no_negative.append(operation.label)
    return cases, statuses, no_negative


def assert_still_serves(url: str) -> None:
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]})
        assert created.status_code == 200, created.text
        sid = created.json()["session_id"]
        ok = http.post(f"/v1/sessions/{sid}/verify", json={
            "position": 3, "last_token": 4, "draft_ids": [5], "log_uniforms": [-0.1],
            "final_uniform": 0.5})
        assert ok.status_code == 200, ok.text
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204


# (mode, operations at least, cases at least): every operation follows the schema; all but the
# GETs (nothing to break) and DELETE (any id is valid) break it.
EXPECTED = [(GenerationMode.POSITIVE, 8, 300), (GenerationMode.NEGATIVE, 3, 200)]


@pytest.mark.parametrize(("mode", "min_operations", "min_cases"), EXPECTED)
def test_no_server_errors_and_the_server_survives(fuzz_server: LiveServer, api_schema: Any,
                                                  mode: GenerationMode, min_operations: int,
                                                  min_cases: int) -> None:
    cases, statuses, no_negative = fuzz(fuzz_server.url, api_schema, mode)
    print(f"\nschemathesis {mode.value}: {sum(cases.values())} cases over {len(cases)} "
          f"operations; statuses {dict(sorted(statuses.items()))}; nothing to break for "
          f"{no_negative}")
    assert len(cases) >= min_operations and sum(cases.values()) >= min_cases, cases
    assert not [s for s in statuses if s >= 500]
    assert_still_serves(fuzz_server.url)
