"""What an adversarial run broke (issue #12), one test per class: degenerate sampling values,
the per-key quota under concurrency, session ids across keys, a flooding key, slow or stalled
connections, settings that do not fit the model, and error shapes."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from drafter_client import SpecDecClient
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.sockets import STILL_OPEN, read_all
from tests.support.waiting import wait_until
from verifier_service.launch import VerifierProcess, free_port
from verifier_service.settings import Settings

K1, K2 = "hardening-key-one", "hardening-key-two"
AUTH1, AUTH2 = {"authorization": f"Bearer {K1}"}, {"authorization": f"Bearer {K2}"}
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models["gpt2-target"], api_keys=f"{K1},{K2}",
                         max_draft_tokens=8, max_sessions_per_key=2, header_timeout_s=1.0,
                         body_timeout_s=1.0)


# -- 1. degenerate sampling values --------------------------------------------------------------
@pytest.mark.parametrize(("temperature", "top_p"), [(1e-40, 1.0), (5e-324, 1.0), (1.0, 1e-50),
                                                    (0.7, 1e-300), (1e-300, 1e-300)])
def test_degenerate_sampling_values_are_served_as_their_limit(
        server: LiveServer, tiny_models: dict[str, Path], temperature: float,
        top_p: float) -> None:
    """A vanishing temperature or top-p is greedy in the limit: every path gives the greedy
    output (argmax ties have probability zero with random weights)."""
    greedy_client = SpecDecClient(server.url, None, tokenizer=str(tiny_models["gpt2-target"]),
                                  api_key=K1)
    prompt = [2, 3, 4, 5]
    greedy = greedy_client.baseline(prompt, max_new_tokens=10).token_ids
    base = greedy_client.baseline(prompt, max_new_tokens=10, temperature=temperature,
                                  top_p=top_p)
    assert base.token_ids == greedy
    for drafter in ("ngram", str(tiny_models["gpt2-drafter"])):  # one-hot and sampled drafts
        client = SpecDecClient(server.url, drafter, tokenizer=str(tiny_models["gpt2-target"]),
                               dtype="float32", api_key=K1)
        out = client.generate(prompt, num_draft_tokens=3, max_new_tokens=10, seed=3,
                              temperature=temperature, top_p=top_p)
        assert out.token_ids == greedy, drafter


# -- 2. the per-key quota under concurrency -----------------------------------------------------
def test_per_key_quota_holds_for_concurrent_creates(server: LiveServer) -> None:
    statuses: list[int] = []
    start = threading.Barrier(10)

    def create(i: int) -> None:
        start.wait()
        r = httpx.post(f"{server.url}/v1/sessions", headers=AUTH2, timeout=30,
                       json={"prompt_ids": [2, 3, 4], "session_id": f"quota-{i:04d}-x"})
        statuses.append(r.status_code)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(statuses) == {200: 2, 429: 8}
    for i in range(10):
        httpx.delete(f"{server.url}/v1/sessions/quota-{i:04d}-x", headers=AUTH2)


# -- 3. session ids across keys -----------------------------------------------------------------
def test_session_ids_are_private_to_their_key(server: LiveServer) -> None:
    sid = "sessAAAA1111"
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/v1/sessions", headers=AUTH1,
                         json={"prompt_ids": [2, 3, 4], "session_id": sid}).status_code == 200
        # k2 can neither detect nor block k1's id: the same id is simply its own session.
        theirs = http.post("/v1/sessions", headers=AUTH2,
                           json={"prompt_ids": [5, 6], "session_id": sid})
        assert theirs.status_code == 200 and theirs.json()["position"] == 2
        assert http.delete(f"/v1/sessions/{sid}", headers=AUTH2).status_code == 204
        mine = http.post(f"/v1/sessions/{sid}/verify", headers=AUTH1, json={
            "position": 3, "last_token": 4, "draft_ids": [], "log_uniforms": [],
            "final_uniform": 0.5})
        assert mine.status_code == 200, mine.text
        assert http.delete(f"/v1/sessions/{sid}", headers=AUTH1).status_code == 204


# -- 4. a flooding key next to a slow client ----------------------------------------------------
@pytest.mark.slow  # a flood held for seconds beside a slow client
def test_flooding_key_does_not_evict_a_slow_client(tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["gpt2-target"], api_keys=f"{K1},{K2}",
                             max_draft_tokens=8, max_sessions=6, max_context=64,
                             kv_budget_tokens=64 * 6)
    drafter = str(tiny_models["gpt2-drafter"])
    with LiveServer(settings) as live:
        quiet = SpecDecClient(live.url, drafter, dtype="float32", api_key=K1).generate(
            [2, 3, 4, 5], num_draft_tokens=2, max_new_tokens=12).token_ids
        stop, flood = threading.Event(), Counter()

        def flooder() -> None:
            with httpx.Client(base_url=live.url, headers=AUTH2, timeout=30) as http:
                i = 0
                while not stop.is_set():
                    i += 1
                    r = http.post("/v1/sessions", json={"prompt_ids": [2, 3],
                                                        "session_id": f"flood-{i:06d}"})
                    flood[r.status_code] += 1

        thread = threading.Thread(target=flooder)
        thread.start()
        try:
            # the flooder fills the session table (6) and goes on evicting its own
            wait_until(lambda: flood[200] > 2 * settings.max_sessions, what="the flood")
            slow = SpecDecClient(live.url, drafter, dtype="float32", api_key=K1,
                                 simulated_rtt_ms=600)
            result = slow.generate([2, 3, 4, 5], num_draft_tokens=2, max_new_tokens=12)
        finally:
            stop.set()
            thread.join()
        metrics = httpx.get(f"{live.url}/v1/metrics", headers=AUTH1).json()
    assert result.token_ids == quiet
    assert result.metrics.session_reopens == 0  # its session was never evicted
    assert flood[200] > 50 and metrics["evicted_sessions"] > 50  # the flooder evicted its own


# -- 5. slow and stalled connections ------------------------------------------------------------
def test_idle_slow_and_stalled_connections_get_408_and_are_closed(server: LiveServer) -> None:
    host, port = "127.0.0.1", server.port
    idle = socket.create_connection((host, port))
    slowloris = socket.create_connection((host, port))
    slowloris.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    stalled = socket.create_connection((host, port))
    stalled.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                    K1.encode() + b"\r\ncontent-type: application/json\r\n"
                    b"content-length: 900000\r\n\r\n{\"prompt_ids\": [")
    # A normal client is served meanwhile.
    assert httpx.get(f"{server.url}/v1/info", headers=AUTH1, timeout=10).status_code == 200
    for sock in (idle, slowloris, stalled):  # 1 s deadlines: answered and closed, not held
        answer = read_all(sock, timeout_s=15)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request_timeout" in answer and not answer.endswith(STILL_OPEN)
        sock.close()


def test_connections_beyond_the_bound_close_the_longest_waiting(
        tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["gpt2-target"], max_connections=4,
                             header_timeout_s=30.0)
    with LiveServer(settings) as live:
        idle = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(6)]
        # The server has taken all six once the fifth and sixth closed the two oldest.
        answers = [read_all(sock, timeout_s=15) for sock in idle[:2]]
        # Idle connections cannot lock a real client out: the longest-waiting ones make room.
        for _ in range(3):
            assert httpx.get(f"{live.url}/v1/info", timeout=5).status_code == 200
        # The first call's connection closed the oldest one left (answered before its call was
        # read); the later ones fit in the bound, and the other idle ones stay open (read for
        # 0.2 s: no answer).
        answers.append(read_all(idle[2], timeout_s=15))
        answers += [read_all(sock, timeout_s=0.2) for sock in idle[3:]]
        for sock in idle:
            sock.close()
    closed = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(closed) >= 3 and all(b"request_timeout" in a for a in closed)
    assert answers[0].startswith(b"HTTP/1.1 408"), [a[:12] for a in answers]  # the oldest first


# -- 6. settings that do not fit the model ------------------------------------------------------
def test_settings_that_do_not_fit_the_model_refuse_to_start(tiny_models: dict[str, Path]) -> None:
    # The tiny model holds 256 positions: a 300-token prompt limit cannot be honoured.
    run = subprocess.run([str(BIN / "specdec-verifier"), "--model",
                          str(tiny_models["gpt2-target"]), "--device", "cpu",
                          "--max-prompt-tokens", "300", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("specdec-verifier:")]
    assert len(errors) == 1 and "--max-prompt-tokens (SPECDEC_MAX_PROMPT_TOKENS)" in errors[0]
    assert "Traceback" not in run.stderr


# -- 7. error shapes ----------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "content_type", "status", "code"), [
    (b"{not json", "application/json", 400, "invalid_json"),
    (b'{"prompt_ids": [2, 3, "\xff\xfe"]}', "application/json", 400, "invalid_json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "invalid_json"),
    (b'{"prompt_ids": [2, 3]}', "text/plain", 415, "unsupported_media_type"),
    (b'{"prompt_ids": ["1", "2"]}', "application/json", 422, "invalid_request"),
    (b'{"prompt_ids": [1.0, 2.0]}', "application/json", 422, "invalid_request"),
    (b'{"prompt_ids": [true, 2]}', "application/json", 422, "invalid_request"),
])
def test_error_shapes(server: LiveServer, body: bytes, content_type: str, status: int,
                      code: str) -> None:
    r = httpx.post(f"{server.url}/v1/sessions", content=body, timeout=30,
                   headers={**AUTH1, "content-type": content_type})
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["field"] in ("body", "prompt_ids.0")
    assert httpx.get(f"{server.url}/v1/info", headers=AUTH1).status_code == 200


def test_unknown_paths_use_the_error_shape(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH1)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server.url}/v1/sessions", headers=AUTH1)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_calls_cut_off_by_shutdown_get_a_retryable_503(tiny_models: dict[str, Path]) -> None:
    verifier = VerifierProcess(["--model", str(tiny_models["gpt2-target"]), "--dtype",
                                "float32", "--shutdown-grace-s", "1", "--body-timeout-s", "30"])
    with verifier:
        stalled = socket.create_connection(("127.0.0.1", verifier.port))
        stalled.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                        b"application/json\r\ncontent-length: 100\r\n\r\n{\"prompt_ids\"")
        # The call is in flight, reading its body, once a later call has been answered: the
        # server reads its connections in the order their data came.
        assert httpx.get(verifier.url + "/healthz", timeout=30).status_code == 200
        assert verifier.proc is not None
        verifier.proc.terminate()
        answer = read_all(stalled, timeout_s=10)
        stalled.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
    assert b"retry-after: 1" in answer.lower() and b"shutting_down" in answer


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_both_http_parsers_bound_and_time_out_request_heads(tiny_models: dict[str, Path],
                                                            parser: str) -> None:
    """A head over 16 KiB is refused (431 from the httptools guard, 400 from h11's own bound)
    and a head that never ends gets 408, with either parser; a normal call is served."""
    settings = fp32_settings(tiny_models["gpt2-target"], http_parser=parser,
                             header_timeout_s=1.0)
    with LiveServer(settings) as live:
        huge = socket.create_connection(("127.0.0.1", live.port))
        huge.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n" +
                     b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20)))
        slow = socket.create_connection(("127.0.0.1", live.port))
        slow.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\n")
        assert httpx.get(f"{live.url}/v1/info", timeout=10).status_code == 200
        answer = read_all(huge, timeout_s=15)
        assert answer.startswith(b"HTTP/1.1 431" if parser == "httptools" else b"HTTP/1.1 400")
        assert read_all(slow, timeout_s=15).startswith(b"HTTP/1.1 408")
        huge.close()
        slow.close()
