"""Which verifier calls the client repeats: session calls are safe to repeat (verify names its
step), ``/v1/generate`` is not - a timeout may leave the first run going on the verifier
(#57: a slow plain run retried 4 times, 6,734 steps, then 503)."""

from __future__ import annotations

import httpx
import pytest

from drafter_client.transport import HttpVerifier, SpecDecError, VerifierUnavailable
from shared.protocol.schema import GenerateRequest, VerifyRequest


def verifier(handler: httpx.MockTransport) -> tuple[HttpVerifier, list[str]]:
    client = httpx.Client(base_url="http://verifier", transport=handler)
    return HttpVerifier("http://verifier", client=client, retry_budget_s=0.5), []


def timing_out(calls: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ReadTimeout("no answer in time", request=request)
    return httpx.MockTransport(handle)


def test_a_generate_that_timed_out_is_not_sent_again() -> None:
    calls: list[str] = []
    http, _ = verifier(timing_out(calls))
    with pytest.raises(SpecDecError, match="not repeated"):
        http.generate(GenerateRequest(prompt_ids=[1, 2], max_new_tokens=8))
    assert calls == ["/v1/generate"]


def test_a_verify_that_timed_out_is_repeated() -> None:
    """The control: the same fault on a session call is retried until the budget ends."""
    calls: list[str] = []
    http, _ = verifier(timing_out(calls))
    with pytest.raises(VerifierUnavailable):
        http.verify("s", VerifyRequest(position=2, last_token=1, final_uniform=0.5))
    assert len(calls) > 1


@pytest.mark.parametrize(("status", "repeated"), [(503, True), (429, True), (502, False),
                                                  (504, False)])
def test_a_generate_turned_away_is_repeated_and_one_lost_behind_a_proxy_is_not(
        status: int, repeated: bool) -> None:
    calls: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(status, headers={"retry-after": "0"},
                              json={"error": {"code": "busy", "message": "busy"}})

    http, _ = verifier(httpx.MockTransport(handle))
    with pytest.raises(SpecDecError):
        http.generate(GenerateRequest(prompt_ids=[1, 2], max_new_tokens=8))
    assert (len(calls) > 1) == repeated
