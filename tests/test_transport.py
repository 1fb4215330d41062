"""The client's retry policy and error mapping, against httpx's MockTransport (no server)."""

from __future__ import annotations

import httpx
import orjson
import pytest

import drafter_client.transport as transport
from drafter_client.transport import (
    HttpVerifier,
    SpecDecError,
    VerifierHTTPError,
    VerifierUnavailable,
    retry_delay,
)

INFO = {"protocol_version": 1, "model": "m", "vocab_size": 8, "tokenizer_fingerprint": "f",
        "eos_token_ids": [1], "max_context": 64, "max_draft_tokens": 8, "max_new_tokens": 64,
        "dtype": "float32", "device": "cpu"}


def verifier(answers: list[httpx.Response | Exception],
             budget_s: float = 60.0) -> tuple[HttpVerifier, list[str]]:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client = httpx.Client(base_url="http://verifier", transport=httpx.MockTransport(handle))
    return HttpVerifier("http://verifier", client=client, retry_budget_s=budget_s), seen


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake clock: sleeping advances it at once."""
    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    monkeypatch.setattr(transport.time, "monotonic", lambda: sum(slept))
    return slept


def test_backoff_doubles_to_two_seconds_and_honours_retry_after() -> None:
    for attempt, base in ((0, 0.1), (1, 0.2), (3, 0.8), (8, 2.0)):
        delays = [retry_delay(None, attempt) for _ in range(50)]
        assert all(base <= d <= 1.5 * base for d in delays), (attempt, min(delays), max(delays))
    assert 3.0 <= retry_delay("3", 0) <= 4.5
    assert retry_delay("120", 0) <= 45.0  # capped at 30 s (+ jitter)
    assert 0.1 <= retry_delay("soon", 0) <= 0.15  # unparsable: plain backoff


def test_overload_and_connection_errors_are_retried(no_sleep: list[float]) -> None:
    v, seen = verifier([httpx.ConnectError("refused"),
                        httpx.Response(503, headers={"retry-after": "1"}),
                        httpx.Response(429), httpx.Response(200, json=INFO)])
    assert v.info().vocab_size == 8
    assert len(seen) == 4 and v.retries == 3
    assert 1.0 <= no_sleep[1] <= 1.5  # Retry-After of the 503


def test_retry_budget_ends_in_one_clear_error(no_sleep: list[float]) -> None:
    v, _ = verifier([httpx.Response(502)] * 100, budget_s=1.0)
    with pytest.raises(VerifierUnavailable, match="retry budget 1 s"):
        v.info()
    assert 0 < sum(no_sleep) <= 1.0  # slept no longer than the budget


def test_errors_map_to_status_code_and_field() -> None:
    body = orjson.dumps({"error": {"code": "position_mismatch", "message": "at 7",
                                   "field": "position", "position": 7}})
    v, _ = verifier([httpx.Response(409, content=body)])
    with pytest.raises(VerifierHTTPError) as info:
        v.info()
    err = info.value
    assert (err.status, err.code, err.field, err.position) == (409, "position_mismatch",
                                                               "position", 7)
    v, _ = verifier([httpx.Response(500, text="Internal Server Error")])
    with pytest.raises(VerifierHTTPError, match="500"):
        v.info()
    v, seen = verifier([httpx.Response(200, json={"not": "a verifier"})])
    with pytest.raises(SpecDecError, match="not a specdec verifier response"):
        v.info()
    assert v.retries == 0 and len(seen) == 1  # neither 4xx/5xx nor garbage is retried


def test_unresolvable_host_fails_at_once() -> None:
    v, seen = verifier([httpx.ConnectError("[Errno -2] Name or service not known")])
    with pytest.raises(SpecDecError, match="cannot reach"):
        v.info()
    assert v.retries == 0 and len(seen) == 1
