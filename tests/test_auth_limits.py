"""API keys (no key / wrong key / right key, sessions belong to their key) and limits whose
4xx names the limit's value."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from drafter_client import SpecDecClient
from drafter_client.transport import SpecDecError
from tests.support.live_server import LiveServer, fp32_settings
from verifier_service.guards import ApiKeyAuth
from verifier_service.settings import Settings

KEYS = ("alpha-key-0123", "beta-key-4567")


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models["gpt2-target"], api_keys=",".join(KEYS),
                         max_sessions_per_key=2, max_body_bytes=4096, max_new_tokens=16,
                         max_draft_tokens=4, max_context=64, max_prompt_tokens=32)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def create(http: httpx.Client, key: str, prompt: list[int] | None = None) -> httpx.Response:
    return http.post("/v1/sessions", json={"prompt_ids": prompt or [2, 3, 4]}, headers=auth(key))


def verify_body(position: int = 3) -> dict[str, object]:
    return {"position": position, "last_token": 4, "draft_ids": [5, 6],
            "log_uniforms": [-0.1, -0.2], "final_uniform": 0.5}


def test_probes_stay_open_everything_else_needs_a_key(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/healthz").status_code == 200
        ready = http.get("/readyz")  # open to probes, so it names nothing
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        for path in ("/v1/info", "/v1/metrics", "/openapi.json"):
            missing = http.get(path)
            assert missing.status_code == 401, path
            assert missing.json()["error"]["code"] == "unauthorized"
            assert "no API key" in missing.json()["error"]["message"]
            assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = http.get("/v1/info", headers=auth("alpha-key-0124"))
        assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
        assert http.get("/v1/info", headers=auth(KEYS[0])).status_code == 200
        assert http.get("/v1/info", headers={"x-api-key": KEYS[1]}).status_code == 200
        # Writes without a key are refused before anything is parsed or touched.
        assert http.post("/v1/sessions", json={"prompt_ids": [1]}).status_code == 401
        assert http.post("/v1/generate", json={"prompt_ids": [1]},
                         headers=auth("nope")).status_code == 401


def test_sessions_belong_to_the_key_that_opened_them(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        sid = create(http, KEYS[0]).json()["session_id"]
        other = http.post(f"/v1/sessions/{sid}/verify", json=verify_body(), headers=auth(KEYS[1]))
        assert other.status_code == 404  # to another key the session does not exist
        assert http.delete(f"/v1/sessions/{sid}", headers=auth(KEYS[1])).status_code == 404
        mine = http.post(f"/v1/sessions/{sid}/verify", json=verify_body(), headers=auth(KEYS[0]))
        assert mine.status_code == 200, mine.text
        assert http.delete(f"/v1/sessions/{sid}", headers=auth(KEYS[0])).status_code == 204


def test_sessions_per_key_limit(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        first = [create(http, KEYS[0]).json()["session_id"] for _ in range(2)]
        third = create(http, KEYS[0])
        assert third.status_code == 429
        assert third.headers["retry-after"] == "1"
        assert "holds 2 open sessions" in third.json()["error"]["message"]
        other = create(http, KEYS[1])  # the other key has its own quota
        assert other.status_code == 200
        http.delete(f"/v1/sessions/{first[0]}", headers=auth(KEYS[0]))
        again = create(http, KEYS[0])
        assert again.status_code == 200, again.text
        for sid, key in ((first[1], KEYS[0]), (again.json()["session_id"], KEYS[0]),
                         (other.json()["session_id"], KEYS[1])):
            http.delete(f"/v1/sessions/{sid}", headers=auth(key))


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/v1/sessions", {"prompt_ids": list(range(2, 40))}, 413, "the limit is 32"),
    ("/v1/generate", {"prompt_ids": [2, 3], "max_new_tokens": 17}, 422, "the limit 16"),
    ("/v1/sessions", {"prompt_ids": [2] * 2500}, 413, "limit of 4096 bytes"),
])
def test_limits_name_their_value(server: LiveServer, path: str, body: dict[str, object],
                                 status: int, words: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post(path, json=body, headers=auth(KEYS[0]))
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"]


def test_draft_and_context_limits_name_their_value(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        sid = create(http, KEYS[0], list(range(2, 32))).json()["session_id"]
        too_many = {"position": 30, "last_token": 31, "draft_ids": [5] * 5,
                    "log_uniforms": [-0.1] * 5, "final_uniform": 0.5}
        response = http.post(f"/v1/sessions/{sid}/verify", json=too_many, headers=auth(KEYS[0]))
        assert response.status_code == 422 and "at most 4" in response.json()["error"]["message"]
        # Walk the session to the context limit (64) with 4-token blocks, then overflow it.
        position, last = 30, 31
        while position + 4 <= 64:
            ok = http.post(f"/v1/sessions/{sid}/verify", headers=auth(KEYS[0]), json={
                "position": position, "last_token": last, "draft_ids": [5] * 4,
                "log_uniforms": [-0.1] * 4, "final_uniform": 0.5})
            assert ok.status_code == 200, ok.text
            position, last = ok.json()["position"], ok.json()["next_token"]
        over = http.post(f"/v1/sessions/{sid}/verify", headers=auth(KEYS[0]), json={
            "position": position, "last_token": last, "draft_ids": [5] * 4,
            "log_uniforms": [-0.1] * 4, "final_uniform": 0.5})
        assert over.status_code == 422
        assert "exceeds max_context 64" in over.json()["error"]["message"]
        http.delete(f"/v1/sessions/{sid}", headers=auth(KEYS[0]))


def test_chunked_body_over_the_limit_is_refused(server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: the limit is counted while reading
        yield b'{"prompt_ids": ['
        for _ in range(1500):
            yield b"2, "
        yield b"2]}"

    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/sessions", content=chunks(),
                             headers={**auth(KEYS[0]), "content-type": "application/json"})
        assert response.status_code == 413, response.text
        assert http.get("/v1/info", headers=auth(KEYS[0])).status_code == 200  # still serving


def test_client_with_no_wrong_or_right_key(server: LiveServer, tiny_models: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = str(tiny_models["gpt2-target"])
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    for key in (None, "wrong-key"):
        with pytest.raises(SpecDecError) as err:
            SpecDecClient(server.url, "ngram", tokenizer=tokenizer, api_key=key)
        message = str(err.value)
        assert "401" in message and "--api-key" in message and "\n" not in message
    client = SpecDecClient(server.url, "ngram", tokenizer=tokenizer, api_key=KEYS[1])
    assert len(client.generate([2, 3, 4], max_new_tokens=8).token_ids) >= 1
    monkeypatch.setenv("SPECDEC_API_KEY", KEYS[0])  # the environment variable works too
    client = SpecDecClient(server.url, None, tokenizer=tokenizer)
    assert len(client.baseline([2, 3, 4], max_new_tokens=4).token_ids) >= 1


def test_keys_are_compared_by_digest_against_every_key() -> None:
    guard = ApiKeyAuth(app=None, keys=["k1-secret", "k2-secret"])
    assert guard.owner_of("k1-secret") != guard.owner_of("k2-secret")
    assert guard.owner_of("k1-secret") is not None
    assert guard.owner_of("k1-secreT") is None and guard.owner_of("") is None
    assert guard.owner_of(None) is None
    assert "secret" not in str(guard.owner_of("k1-secret"))  # owners never carry the key
