"""Bad input gets a 4xx whose message names the problem, and the server keeps serving."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.support.live_server import LiveServer


@pytest.fixture()
def http(llama_server: LiveServer):  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=llama_server.url, timeout=30) as client:
        yield client


def new_session(http: httpx.Client, prompt: list[int] | None = None) -> dict:
    response = http.post("/v1/sessions", json={"prompt_ids": prompt or [2, 3, 4]})
    assert response.status_code == 200, response.text
    return response.json()


def verify_body(**overrides: object) -> dict:
    body = {"position": 3, "last_token": 4, "draft_ids": [5, 6], "draft_logprobs": None,
            "log_uniforms": [-0.1, -0.2], "final_uniform": 0.5}
    body.update(overrides)
    return body


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("overrides", "status", "field", "words"), [
    ({"draft_ids": [5, 64]}, 422, "draft_ids", "outside [0, 64)"),  # vocab is 64
    ({"draft_ids": [-1, 2]}, 422, "draft_ids", "outside"),
    ({"last_token": 1000}, 422, "last_token", "outside"),
    ({"draft_ids": list(range(9)), "log_uniforms": [-0.1] * 9}, 422, "draft_ids", "at most 8"),
    ({"log_uniforms": [-0.1]}, 422, "log_uniforms", "1 entries for 2 drafts"),
    ({"draft_logprobs": [-0.1]}, 422, "draft_logprobs", "1 entries for 2 drafts"),
    ({"log_uniforms": [0.5, -0.1]}, 422, "log_uniforms", "<= 0"),
    ({"final_uniform": 1.5}, 422, "final_uniform", "less than 1"),
    ({"position": 7}, 409, "position", "session's position 3"),
    ({"draft_ids": "abc"}, 422, "draft_ids", "valid list"),
    ({"surprise": 1}, 422, "surprise", "not permitted"),
])
def test_bad_verify_bodies(http, overrides, status, field, words):  # type: ignore[no-untyped-def]
    session = new_session(http)
    response = http.post(f"/v1/sessions/{session['session_id']}/verify",
                         json=verify_body(**overrides))
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["field"] == field
    assert words in error["message"]
    # The session survived: a correct call on it still works.
    ok = http.post(f"/v1/sessions/{session['session_id']}/verify", json=verify_body())
    assert ok.status_code == 200, ok.text
    assert ok.json()["position"] == 3 + ok.json()["num_accepted"] + 1


def test_malformed_json(http):  # type: ignore[no-untyped-def]
    response = http.post("/v1/sessions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"
    assert error_of(response)["field"] == "body"
    assert http.get("/readyz").status_code == 200


def test_unknown_session(http):  # type: ignore[no-untyped-def]
    response = http.post("/v1/sessions/nope/verify", json=verify_body())
    assert response.status_code == 404
    assert error_of(response)["code"] == "session_not_found"
    assert http.delete("/v1/sessions/nope").status_code == 404


def test_context_over_the_maximum(http):  # type: ignore[no-untyped-def]
    # max_context is 64 for this server
    response = http.post("/v1/sessions", json={"prompt_ids": [2] * 70})
    assert response.status_code == 413
    assert error_of(response)["field"] == "prompt_ids" and "limit is 63" in error_of(response)[
        "message"]
    session = new_session(http, [2] * 60)
    response = http.post(f"/v1/sessions/{session['session_id']}/verify", json=verify_body(
        position=60, last_token=2, draft_ids=[3] * 5, log_uniforms=[-0.1] * 5))
    assert response.status_code == 422
    assert error_of(response)["code"] == "context_overflow"
    assert "max_context 64" in error_of(response)["message"]


@pytest.mark.parametrize(("sampling", "field"), [
    ({"temperature": -1}, "sampling.temperature"),
    ({"top_k": -3}, "sampling.top_k"),
    ({"top_p": 0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"temperature": "hot"}, "sampling.temperature"),
])
def test_bad_sampling_values(http, sampling, field):  # type: ignore[no-untyped-def]
    response = http.post("/v1/sessions", json={"prompt_ids": [2, 3], "sampling": sampling})
    assert response.status_code == 422
    assert error_of(response)["field"] == field


def test_bad_prompts_and_generate_limits(http):  # type: ignore[no-untyped-def]
    response = http.post("/v1/sessions", json={"prompt_ids": []})
    assert response.status_code == 422 and error_of(response)["field"] == "prompt_ids"
    response = http.post("/v1/sessions", json={"prompt_ids": [99]})
    assert response.status_code == 422 and error_of(response)["code"] == "token_out_of_vocab"
    response = http.post("/v1/sessions", json={"prompt_ids": [2], "protocol_version": 99})
    assert response.status_code == 400 and error_of(response)["field"] == "protocol_version"
    response = http.post("/v1/generate", json={"prompt_ids": [2], "max_new_tokens": 10**6})
    assert response.status_code == 422 and error_of(response)["field"] == "max_new_tokens"
    body = orjson.dumps({"prompt_ids": [2, 3], "max_new_tokens": 3})
    response = http.post("/v1/generate", content=body)  # no content-type header
    assert response.status_code == 415, response.text
    assert "content-type: application/json" in error_of(response)["message"]
    response = http.post("/v1/generate", content=body,
                         headers={"content-type": "application/json"})
    assert response.status_code == 200 and len(response.json()["token_ids"]) <= 3


def test_info_describes_the_target(http):  # type: ignore[no-untyped-def]
    info = http.get("/v1/info").json()
    assert info["vocab_size"] == 64 and info["max_context"] == 64
    assert info["max_draft_tokens"] == 8 and info["protocol_version"] == 1
    assert info["dtype"] == "float32" and info["eos_token_ids"] == [1]
    assert http.get("/healthz").json() == {"status": "ok"}
