"""Batching many sessions into one forward: same answers as alone, pooled KV, backpressure."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from drafter_client import SpecDecClient
from tests.support.live_server import LiveServer, fp32_settings
from verifier_service.settings import Settings

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17], [18, 19],
           [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [30, 31, 32, 33], [34, 35, 36, 37, 38, 39]]


@pytest.fixture(scope="module", params=[("per-session", "device"), ("padded", "device"),
                                        ("per-session", "host")], ids=lambda p: "-".join(p))
def server_settings(tiny_models: dict[str, Path], request: pytest.FixtureRequest) -> Settings:
    """``server``: batched with each attention layout and each acceptance path (the lone server
    below attends per session and decides on the device)."""
    attention, acceptance = request.param
    # a long batching window makes concurrent calls meet in one forward
    return fp32_settings(tiny_models["llama-target"], max_draft_tokens=8, batch_wait_ms=50.0,
                         attention=attention, acceptance=acceptance)


@pytest.fixture(scope="module")
def lone_server(tiny_models: dict[str, Path],
                start_server: Callable[[Settings], LiveServer]) -> LiveServer:
    return start_server(fp32_settings(tiny_models["llama-target"], max_draft_tokens=8,
                                      batching=False))


def metrics(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/v1/metrics").json()  # type: ignore[no-any-return]


async def one_session(http: httpx.AsyncClient, i: int) -> tuple[dict, dict]:
    prompt = PROMPTS[i]
    created = await http.post("/v1/sessions", json={
        "prompt_ids": prompt, "sampling": {"temperature": 1.0}})
    assert created.status_code == 200, created.text
    sid = created.json()["session_id"]
    drafts = [(7 * i + j) % 64 for j in range(1 + i % 4)]  # ragged: 1..4 drafts
    first = await http.post(f"/v1/sessions/{sid}/verify", json={
        "position": len(prompt), "last_token": prompt[-1], "draft_ids": drafts,
        "draft_logprobs": [-1.0] * len(drafts), "log_uniforms": [-3.0] * len(drafts),
        "final_uniform": 0.3})
    assert first.status_code == 200, first.text
    reply = first.json()
    second = await http.post(f"/v1/sessions/{sid}/verify", json={
        "position": reply["position"], "last_token": 9, "draft_ids": [3, 4],
        "draft_logprobs": [-1.0, -1.0], "log_uniforms": [-0.5, -0.5], "final_uniform": 0.7})
    assert second.status_code == 200, second.text
    return reply, second.json()


async def run_sessions(url: str, concurrent: bool) -> list[tuple[dict, dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        if concurrent:
            return list(await asyncio.gather(*(one_session(http, i)
                                               for i in range(len(PROMPTS)))))
        return [await one_session(http, i) for i in range(len(PROMPTS))]


def test_batched_logprobs_equal_the_same_calls_alone(server: LiveServer,
                                                     lone_server: LiveServer) -> None:
    before = metrics(server)["batches"]
    batched = asyncio.run(run_sessions(server.url, concurrent=True))
    after = metrics(server)
    alone = asyncio.run(run_sessions(lone_server.url, concurrent=False))
    assert after["batches"] - before < 3 * len(PROMPTS)  # calls really shared forwards
    assert max(int(size) for size in after["batch_sizes"]) > 1
    assert metrics(lone_server)["batch_sizes"].keys() == {"1"}
    for (b1, b2), (a1, a2) in zip(batched, alone, strict=True):
        for b, a in ((b1, a1), (b2, a2)):
            assert b["num_accepted"] == a["num_accepted"]
            assert b["next_token"] == a["next_token"] and b["position"] == a["position"]
            assert b["target_logprobs"] == pytest.approx(a["target_logprobs"], abs=1e-5)


def test_greedy_generations_identical_with_eight_clients(server: LiveServer,
                                                         tiny_models: dict[str, Path]) -> None:
    drafter = str(tiny_models["llama-drafter"])
    prompts = ["the cat sat on", "a big red dog ran", "def x ( y ) :", "if x = 1",
               "the mat", "red cat", "y + 1 = 2", "return x"]
    client = SpecDecClient(server.url, drafter, dtype="float32", device="cpu")
    alone = [client.generate(p, num_draft_tokens=3, max_new_tokens=24).token_ids
             for p in prompts]
    results: dict[int, list[int]] = {}
    # Models load here, one at a time: from_pretrained is not safe to run in parallel threads.
    clients = [SpecDecClient(server.url, drafter, dtype="float32", device="cpu")
               for _ in range(8)]
    before = metrics(server)

    def worker(i: int) -> None:
        results[i] = clients[i].generate(prompts[i], num_draft_tokens=3,
                                         max_new_tokens=24).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics(server)
    assert [results[i] for i in range(8)] == alone
    assert after["jobs"] - before["jobs"] > after["batches"] - before["batches"]  # batched


def test_kv_budget_evicts_the_least_recently_used_idle_session(
        tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["gpt2-target"], max_context=64, kv_budget_tokens=128,
                             session_protect_s=0.0)
    with LiveServer(settings) as server, httpx.Client(base_url=server.url) as http:
        assert metrics(server)["kv_slots"] == 2
        ids = [http.post("/v1/sessions", json={"prompt_ids": [2, 3]}).json()["session_id"]
               for _ in range(3)]
        assert metrics(server)["evicted_sessions"] == 1
        gone = http.post(f"/v1/sessions/{ids[0]}/verify", json={
            "position": 2, "last_token": 3, "final_uniform": 0.5})
        assert gone.status_code == 404  # the oldest idle session made room
        kept = http.post(f"/v1/sessions/{ids[2]}/verify", json={
            "position": 2, "last_token": 3, "final_uniform": 0.5})
        assert kept.status_code == 200


def test_full_queue_answers_429_with_retry_after_and_the_client_retries(
        tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["gpt2-target"], max_queue=1, batching=False)
    with LiveServer(settings) as server:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                return list(await asyncio.gather(*(
                    http.post("/v1/generate", json={"prompt_ids": [2, 3], "max_new_tokens": 30})
                    for _ in range(6))))
        replies = asyncio.run(flood())
        refused = [r for r in replies if r.status_code == 429]
        assert refused and all(r.headers["retry-after"] == "1" for r in refused)
        assert "queue is full" in refused[0].json()["error"]["message"]
        assert any(r.status_code == 200 for r in replies)
        # The client honours Retry-After: two busy clients still both finish.
        client = SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]), dtype="float32",
                               device="cpu")
        other = SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]), dtype="float32",
                              device="cpu")
        done: list[int] = []
        threads = [threading.Thread(target=lambda c=c: done.append(len(
            c.generate("the cat", num_draft_tokens=2, max_new_tokens=30).token_ids)))
            for c in (client, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(done) == 2
        assert metrics(server)["rejected_queue_full"] >= len(refused)


def test_twelve_callers_on_four_kv_slots_without_keys(tiny_models: dict[str, Path]) -> None:
    """No API keys, 4 KV slots, 12 concurrent callers (6 speculative clients, 6 raw
    /v1/generate): a caller either gets its session and the target's greedy output, or a 503
    with Retry-After; no live session is evicted and no reply names a session the caller did
    not open (a generation's own session was evicted by others' creates, and its 404 leaked)."""
    settings = fp32_settings(tiny_models["gpt2-target"], max_context=64, kv_budget_tokens=256)
    prompt = [2, 3, 4, 5]
    with LiveServer(settings) as server:
        assert metrics(server)["kv_slots"] == 4
        expected = SpecDecClient(server.url, None, tokenizer=str(tiny_models["gpt2-target"])
                                 ).baseline(prompt, max_new_tokens=24).token_ids
        outputs: list[list[int]] = []
        replies: list[httpx.Response] = []
        failures: list[BaseException] = []

        def speculative() -> None:
            try:
                client = SpecDecClient(server.url, "ngram",
                                       tokenizer=str(tiny_models["gpt2-target"]))
                outputs.append(client.generate(prompt, num_draft_tokens=2,
                                               max_new_tokens=24).token_ids)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        def raw() -> None:
            replies.append(httpx.post(server.url + "/v1/generate", timeout=60, json={
                "prompt_ids": prompt, "max_new_tokens": 24}))

        threads = [threading.Thread(target=speculative if i % 2 else raw) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failures, failures
        assert outputs == [expected] * 6
        assert len(replies) == 6
        for reply in replies:
            assert reply.status_code in (200, 503), reply.text
            if reply.status_code == 503:
                assert reply.headers["retry-after"] and "session_id" not in reply.text
            else:
                assert reply.json()["token_ids"] == expected
        assert metrics(server)["kv_slots_free"] == 4
