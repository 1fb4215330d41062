"""A client that hangs up stops costing work (issue #42, item 1), streaming or not: the
generation stops within a block of the hang-up, and a request whose client left while it waited
for a worker never starts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from drafter_client.api import SpecDecClient
from drafter_client.gateway import GatewaySettings
from drafter_client.gateway.engine import Gateway
from drafter_client.settings import ClientSettings
from tests.support.live_server import LiveServer
from tests.support.servers import ThreadedServer
from tests.support.waiting import wait_until

MODEL = "tiny-gpt2"
RTT_MS = 25.0  # each verify round trip: a generation of the whole context takes seconds
# No max_tokens: the chat runs to the context's end (256 positions on the tiny model)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the cat sat"}],
        "temperature": 0}


@pytest.fixture(scope="module")
def gateway_client(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    # Plain runs ask for many steps per call; "-k 1" with the ngram drafter keeps one block a
    # few tokens, so "within one block" is a few tokens here.
    return SpecDecClient(gpt2_server.url, "ngram", tokenizer=str(tiny_models["gpt2-drafter"]),
                         settings=ClientSettings(num_draft_tokens="1", simulated_rtt_ms=RTT_MS))


@pytest.fixture(scope="module")
def gateway_settings() -> GatewaySettings:
    return GatewaySettings(MODEL, max_concurrency=1)


@pytest.fixture(scope="module")
def served(gateway: ThreadedServer) -> tuple[ThreadedServer, Gateway]:
    """The gateway and its engine."""
    return gateway, gateway.app.state.gateway


def generated(gateway: Gateway) -> float:
    return gateway.metrics.generated_tokens._value.get()  # type: ignore[attr-defined, no-any-return]


def settle(gateway: Gateway) -> None:
    """Wait until no generation runs or waits."""
    wait_until(lambda: not gateway._admitted, timeout_s=60, what="no generation admitted")


def hang_up(url: str, body: dict[str, object], after_s: float) -> None:
    """Send the request, read what comes for ``after_s`` seconds, close the connection."""
    until = time.monotonic() + after_s
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(30, read=after_s)) as response:
            for _ in response.iter_bytes():
                if time.monotonic() > until:
                    break  # a stream: chunks still coming, the client leaves
            else:
                raise AssertionError("the answer ended before the client hung up")
    except httpx.ReadTimeout:
        pass  # no answer yet, the client leaves


@pytest.mark.slow  # the control's whole generation
def test_a_full_generation_is_long(served: tuple[ThreadedServer, Gateway]) -> None:
    """The control: undisturbed, the same request generates to the context's end, which takes
    far longer than the hang-ups below wait."""
    server, gateway = served
    settle(gateway)
    before = generated(gateway)
    start = time.perf_counter()
    reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["usage"]["completion_tokens"]
    assert tokens >= 100, reply.json()
    assert generated(gateway) - before == tokens
    assert time.perf_counter() - start > 2.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_hang_up_stops_the_generation_within_a_block(
        served: tuple[ThreadedServer, Gateway], stream: bool) -> None:
    server, gateway = served
    settle(gateway)
    before = generated(gateway)
    hang_up(server.url, {**CHAT, "stream": stream}, after_s=0.5)
    settle(gateway)
    # About 0.5 s of generation (a few tokens per block) and the block under way when the
    # client left: far from the context's end, which the control above reaches (counted, not
    # timed, so that a slow machine cannot fail it).
    assert generated(gateway) - before < 60


def test_a_request_whose_client_left_while_waiting_never_starts(
        served: tuple[ThreadedServer, Gateway]) -> None:
    """With one worker busy, a second request waits; its client hangs up; once the first ends,
    nothing runs for the second."""
    server, gateway = served
    settle(gateway)

    first = threading.Thread(target=hang_up, args=(server.url, CHAT, 1.5))
    first.start()
    wait_until(lambda: gateway.metrics.running._value.get() == 1,  # type: ignore[attr-defined]
               what="the first holding the only worker")
    before_second = generated(gateway)
    hang_up(server.url, CHAT, after_s=0.3)
    first.join()
    settle(gateway)
    # The first generated for about 1.5 s; the second not at all (it would add a full
    # context's worth, over 100 tokens).
    assert generated(gateway) - before_second < 100
    ok = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3},
                    timeout=30)
    assert ok.status_code == 200, ok.text


def test_the_verifier_stops_a_generate_whose_caller_hung_up(gpt2_server: LiveServer) -> None:
    """``/v1/generate`` (the target alone: `specdec baseline`, the playground's race) stops at
    its next step when its caller hangs up, and frees its session. The negative control: the
    same call read to its end runs every step (about 0.7 s of them here)."""
    body = {"prompt_ids": [2, 3, 4], "max_new_tokens": 250, "stop_at_eos": False}
    url = gpt2_server.url

    def jobs() -> int:
        return int(httpx.get(url + "/v1/metrics").json()["jobs"])

    before = jobs()
    assert len(httpx.post(url + "/v1/generate", json=body, timeout=120).json()["token_ids"]) == 250
    full = jobs() - before  # one prefill with the first token, then one job per step
    assert full >= 249
    before = jobs()
    with pytest.raises(httpx.ReadTimeout):  # hangs up after 0.15 s
        httpx.post(url + "/v1/generate", json=body, timeout=httpx.Timeout(30, read=0.15))
    wait_until(lambda: httpx.get(url + "/v1/metrics").json()["sessions"] == 0,
               interval_s=0.05, what="the generate's session closed")
    stopped = jobs() - before
    # Kept: nothing happening is the check; for 0.5 s a generation still running would go on
    # adding jobs (one every few ms).
    time.sleep(0.5)
    assert jobs() - before == stopped < full
