"""Schemathesis against the verifier's own OpenAPI schema: no generated request may get a 5xx.

Every operation gets up to ``EXAMPLES`` generated cases that follow the schema and up to as many
that break it (wrong types, missing fields, odd path parameters), sent over HTTP to a live
verifier with a tiny model and API keys on; each test then checks how many cases ran and that
the verifier still serves correctly afterwards, so either runs alone.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.live_server import LiveServer, fp32_settings
from verifier_service.launch import one_session
from verifier_service.settings import Settings

pytestmark = pytest.mark.fuzz
KEY = "fuzz-key-0001"
AUTH = {"authorization": f"Bearer {KEY}"}
EXAMPLES = 100


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models["gpt2-target"], api_keys=KEY, max_new_tokens=8,
                         max_draft_tokens=4, max_context=64, kv_budget_tokens=64 * 8,
                         max_sessions=8, max_body_bytes=65536)


@pytest.fixture(scope="module")
def api_schema(server: LiveServer) -> Any:
    document = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
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
        one_session(http)


# (mode, operations at least, cases at least): every operation follows the schema; all but the
# GETs (nothing to break) and DELETE (any id is valid) break it.
EXPECTED = [(GenerationMode.POSITIVE, 8, 300), (GenerationMode.NEGATIVE, 3, 200)]


@pytest.mark.parametrize(("mode", "min_operations", "min_cases"), EXPECTED)
def test_no_server_errors_and_the_server_survives(server: LiveServer, api_schema: Any,
                                                  mode: GenerationMode, min_operations: int,
                                                  min_cases: int) -> None:
    cases, statuses, no_negative = fuzz(server.url, api_schema, mode)
    print(f"\nschemathesis {mode.value}: {sum(cases.values())} cases over {len(cases)} "
          f"operations; statuses {dict(sorted(statuses.items()))}; nothing to break for "
          f"{no_negative}")
    assert len(cases) >= min_operations and sum(cases.values()) >= min_cases, cases
    assert not [s for s in statuses if s >= 500]
    assert_still_serves(server.url)


# The classes an adversarial run found (issue #12): degenerate floats, ids of the wrong JSON type
# or size, bodies that do not decode. Drawn into every POST operation: none may get a 5xx.
FLOATS = [5e-324, 1e-310, 1e-300, 1e-40, 1e-8, 0.9999999999999999, 1.0, 100.0, 1e300, -0.0,
          -1.0]
IDS = [0, 1, 63, 64, -5, 99999, 2**31, 2**70, "1", 1.0, True, None]


def raw_body(data: Any) -> bytes:
    import json

    return json.dumps(data).encode()


@given(temperature=st.sampled_from(FLOATS), top_p=st.sampled_from(FLOATS),
       top_k=st.sampled_from([0, 1, 5, 2**31 - 1, 2**31, -1]),
       ids=st.lists(st.sampled_from(IDS), min_size=0, max_size=4),
       path=st.sampled_from(["/v1/sessions", "/v1/generate", "verify"]),
       garbage=st.sampled_from([None, b"\xff\xfe{", b"[" * 20000, b"{\"prompt_ids\": [NaN]}",
                                b"{\"prompt_ids\": [Infinity]}"]))
@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_adversarial_classes_never_get_a_server_error(
        server: LiveServer, temperature: float, top_p: float, top_k: int, ids: list[Any],
        path: str, garbage: bytes | None) -> None:
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        if path == "verify":
            created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4],
                                                      "sampling": {"temperature": 1.0}})
            assert created.status_code == 200, created.text
            sid = created.json()["session_id"]
            body: Any = {"position": 3, "last_token": ids[0] if ids else 4, "draft_ids": ids,
                         "draft_logprobs": [-0.5] * len(ids), "log_uniforms": [-0.1] * len(ids),
                         "final_uniform": min(abs(top_p), 0.99)}
            target = f"/v1/sessions/{sid}/verify"
        else:
            body = {"prompt_ids": ids or [2], "sampling": sampling}
            if path == "/v1/generate":
                body["max_new_tokens"] = 4
            target = path
        content = garbage if garbage is not None else raw_body(body)
        response = http.post(target, content=content,
                             headers={"content-type": "application/json"})
        assert response.status_code < 500, (target, content[:200], response.text[:300])
        assert "error" in response.json() or response.status_code == 200
        if path == "verify":
            http.delete(f"/v1/sessions/{sid}")
