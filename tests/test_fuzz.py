"""Schemathesis against the verifier's own OpenAPI schema: no generated request may get a 5xx.

Every operation gets up to ``EXAMPLES`` generated cases that follow the schema and up to as many
that break it (wrong types, missing fields, odd path parameters), sent over HTTP to a live
verifier with a tiny model and API keys on; the last test checks how many cases ran and that
the verifier still serves correctly afterwards.
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
CASES: Counter[str] = Counter()
STATUSES: Counter[int] = Counter()
NO_NEGATIVE: list[str] = []


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
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(fuzz_server: LiveServer, api_schema: Any,
                          mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to break: no parameters, no body

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            response = case.call(base_url=fuzz_server.url, headers=AUTH, timeout=30)
            CASES[f"{case.method} {case.path} {mode.value}"] += 1
            STATUSES[response.status_code] += 1
            assert response.status_code < 500, (case.method, case.formatted_path, case.body,
                                                response.text)

        try:
            call()
        except Unsatisfiable:
            # e.g. DELETE /v1/sessions/{session_id}: any string is a valid id, nothing to break
            assert mode is GenerationMode.NEGATIVE, operation.label
            NO_NEGATIVE.append(operation.label)


def test_fuzzing_ran_and_the_server_survived(fuzz_server: LiveServer) -> None:
    total = sum(CASES.values())
    print(f"\nschemathesis: {total} cases over {len(CASES)} operations; statuses "
          f"{dict(sorted(STATUSES.items()))}; no schema-breaking case exists for {NO_NEGATIVE}")
    assert len(CASES) >= 11 and total >= 400, CASES
    assert not [s for s in STATUSES if s >= 500]
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=30) as http:
        created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]})
        assert created.status_code == 200, created.text
        sid = created.json()["session_id"]
        ok = http.post(f"/v1/sessions/{sid}/verify", json={
            "position": 3, "last_token": 4, "draft_ids": [5], "log_uniforms": [-0.1],
            "final_uniform": 0.5})
        assert ok.status_code == 200, ok.text
