"""Idempotent verify and create; the client resynchronises after lost answers and lost sessions
with output identical to an undisturbed run (greedy and sampled)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from drafter_client import SpecDecClient
from shared.protocol.schema import VerifyRequest, VerifyResponse
from tests.support.fault_proxy import FaultProxy
from tests.support.live_server import LiveServer

PROMPT = [2, 3, 4, 5]


def metrics(http: httpx.Client) -> dict[str, Any]:
    return http.get("/v1/metrics").json()  # type: ignore[no-any-return]


def body(position: int, last: int, drafts: list[int], uniform: float = 0.5) -> dict[str, Any]:
    return {"position": position, "last_token": last, "draft_ids": drafts,
            "log_uniforms": [-0.1] * len(drafts), "final_uniform": uniform}


def test_a_repeated_verify_gets_the_same_answer_and_advances_once(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        sid = http.post("/v1/sessions", json={"prompt_ids": PROMPT}).json()["session_id"]
        before = metrics(http)
        first = http.post(f"/v1/sessions/{sid}/verify", json=body(4, 5, [6, 7, 8]))
        again = http.post(f"/v1/sessions/{sid}/verify", json=body(4, 5, [6, 7, 8]))
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json()
        after = metrics(http)
        assert after["verify_calls"] - before["verify_calls"] == 1
        assert after["replayed_calls"] - before["replayed_calls"] == 1
        position = first.json()["position"]
        # The same step with another body: 409, with the session's position to resync to.
        conflict = http.post(f"/v1/sessions/{sid}/verify", json=body(4, 5, [9]))
        assert conflict.status_code == 409
        assert conflict.json()["error"]["code"] == "step_conflict"
        assert conflict.json()["error"]["position"] == position
        for stale_or_future in (3, position + 2):
            wrong = http.post(f"/v1/sessions/{sid}/verify", json=body(stale_or_future, 5, [6]))
            assert wrong.status_code == 409
            assert wrong.json()["error"]["code"] == "position_mismatch"
            assert wrong.json()["error"]["position"] == position
        nxt = http.post(f"/v1/sessions/{sid}/verify",
                        json=body(position, first.json()["next_token"], [6]))
        assert nxt.status_code == 200, nxt.text
        http.delete(f"/v1/sessions/{sid}")


def test_concurrent_duplicates_get_one_answer(server: LiveServer) -> None:
    """A retry sent while the first call is still queued waits for it, then replays it."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        sid = http.post("/v1/sessions", json={"prompt_ids": PROMPT}).json()["session_id"]
        before = metrics(http)["verify_calls"]
        answers: list[httpx.Response] = []

        def send() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as own:
                answers.append(own.post(f"/v1/sessions/{sid}/verify", json=body(4, 5, [6, 7])))

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a.status_code for a in answers] == [200] * 4
        assert all(a.json() == answers[0].json() for a in answers)
        assert metrics(http)["verify_calls"] - before == 1
        http.delete(f"/v1/sessions/{sid}")


def test_a_repeated_create_is_recognised(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        request = {"prompt_ids": PROMPT, "session_id": "retry-me-0001"}
        sessions = metrics(http)["sessions"]
        first = http.post("/v1/sessions", json=request)
        again = http.post("/v1/sessions", json=request)
        assert first.status_code == again.status_code == 200, again.text
        assert again.json()["session_id"] == "retry-me-0001"
        assert again.json()["position"] == first.json()["position"]
        assert metrics(http)["sessions"] == sessions + 1
        other = http.post("/v1/sessions", json={**request, "prompt_ids": [2, 3]})
        assert other.status_code == 409 and other.json()["error"]["code"] == "session_exists"
        http.delete("/v1/sessions/retry-me-0001")


def reference(server: LiveServer, tiny_models: dict[str, Path], **kw: Any) -> list[int]:
    client = SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]), dtype="float32")
    return client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=40, **kw).token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dropped_responses_do_not_advance_twice(server: LiveServer,
                                                tiny_models: dict[str, Path],
                                                temperature: float) -> None:
    expected = reference(server, tiny_models, temperature=temperature, seed=7)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = metrics(http)
    with FaultProxy(server.url, drop_responses=[2, 5]) as proxy:
        client = SpecDecClient(proxy.url, str(tiny_models["gpt2-drafter"]), dtype="float32")
        result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=40,
                                 temperature=temperature, seed=7)
        assert proxy.dropped == 2
    assert result.token_ids == expected
    with httpx.Client(base_url=server.url, timeout=30) as http:
        after = metrics(http)
    m = result.metrics
    assert m.retries >= 2 and m.session_reopens == 0
    # Each block advanced the verifier's cache exactly once; the two retries were replays.
    assert after["verify_calls"] - before["verify_calls"] == m.verify_calls
    assert after["replayed_calls"] - before["replayed_calls"] == 2
    assert after["sessions"] == before["sessions"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lost_session_is_reopened_with_identical_output(server: LiveServer,
                                                        tiny_models: dict[str, Path],
                                                        temperature: float) -> None:
    """The session is deleted behind the client's back (as eviction or expiry would) after the
    2nd block; the client reopens it with its committed tokens and goes on: same tokens."""
    expected = reference(server, tiny_models, temperature=temperature, seed=3)
    client = SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]), dtype="float32")
    seen: list[str] = []
    verify = client.verifier.verify

    def spy(session_id: str, req: VerifyRequest) -> VerifyResponse:
        seen.append(session_id)
        return verify(session_id, req)

    client.verifier.verify = spy  # type: ignore[method-assign]
    blocks = 0

    def evict(_: list[int]) -> None:
        nonlocal blocks
        blocks += 1
        if blocks == 2:
            assert httpx.delete(f"{server.url}/v1/sessions/{seen[-1]}").status_code == 204

    result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=40,
                             temperature=temperature, seed=3, on_tokens=evict)
    assert result.token_ids == expected
    assert result.metrics.session_reopens == 1
    assert len(set(seen)) == 2


def test_position_conflict_resynchronises(server: LiveServer,
                                          tiny_models: dict[str, Path]) -> None:
    """Someone else advances our session (so our next call meets a 409); the client reopens
    the session from its own committed tokens: same output."""
    expected = reference(server, tiny_models)
    client = SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]), dtype="float32")
    verify = client.verifier.verify
    calls = 0

    def meddle(session_id: str, req: VerifyRequest) -> VerifyResponse:
        nonlocal calls
        calls += 1
        if calls == 3:  # another call at the same step, with other drafts, gets there first
            verify(session_id, req.model_copy(update={"draft_ids": [], "log_uniforms": []}))
        return verify(session_id, req)

    client.verifier.verify = meddle  # type: ignore[method-assign]
    result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=40)
    assert result.token_ids == expected
    assert result.metrics.session_reopens == 1
