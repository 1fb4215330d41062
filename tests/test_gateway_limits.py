"""The gateway holds its ground (issue #26): a body limit checked before parsing, prompts too
long for the context refused before tokenizing, strict types with a 400 naming the field, and
memory that comes back after large requests. Each refusal is in OpenAI's error shape and the
gateway serves normally afterwards."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from drafter_client.api import SpecDecClient
from drafter_client.gateway import GatewaySettings
from drafter_client.gateway.engine import WHITESPACE, visible_chars
from tests.support.live_server import LiveServer
from tests.support.servers import ThreadedServer

MODEL = "tiny-gpt2"
LIMIT = 256 * 1024  # bytes: the gateway's body limit in these tests


class CountingTokenizer:
    """The client's tokenizer, counting the texts it is asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.encoded = inner, 0

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.encoded += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def gateway_client(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    made = SpecDecClient(gpt2_server.url, "ngram", tokenizer=str(tiny_models["gpt2-drafter"]))
    made.tokenizer = CountingTokenizer(made.tokenizer)
    return made


@pytest.fixture(scope="module")
def gateway_settings() -> GatewaySettings:
    return GatewaySettings(MODEL, max_body_bytes=LIMIT, body_timeout_s=1.0)


def post(gateway: ThreadedServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=30)


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


def assert_serves(gateway: ThreadedServer) -> None:
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    reply = oai.completions.create(model=MODEL, prompt="the cat", temperature=0, max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "the cat", "max_tokens": 4}


@pytest.mark.parametrize(("path", "change", "param"), [
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 5.0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("/v1/completions", {"prompt": [[2, "3"]]}, "prompt"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"seed": 10**30}, "seed"),
    ("/v1/completions", {"seed": "7"}, "seed"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"top_k": 2**40}, "top_k"),
    ("/v1/completions", {"model": 3}, "model"),
    ("/v1/completions", {"stop": [1]}, "stop"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                         "text": 3}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"max_completion_tokens": "8"}, "max_completion_tokens"),
])
def test_loose_types_get_a_400_naming_the_field(gateway: ThreadedServer, path: str,
                                                change: dict[str, Any], param: str) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), **change}
    error = openai_error(post(gateway, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error


def test_the_official_clients_requests_still_pass(gateway: ThreadedServer) -> None:
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"},
                               {"role": "user", "content": [{"type": "text", "text": "the"}]}],
        temperature=0.7, top_p=0.9, seed=3, max_completion_tokens=5, stop=["zzz"], n=1,
        presence_penalty=0, frequency_penalty=0, logprobs=False, user="u1")
    assert reply.choices[0].finish_reason in ("stop", "length")
    stream = oai.completions.create(model=MODEL, prompt=[2, 3, 4], max_tokens=5, seed=2**63 - 1,
                                    stream=True, stream_options={"include_usage": True},
                                    temperature=1.0, echo=False, best_of=1)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens >= 1


def test_a_body_over_the_limit_gets_413_before_it_is_parsed(
        gateway: ThreadedServer, gateway_client: SpecDecClient) -> None:
    before = gateway_client.tokenizer.encoded
    body = {**COMPLETION, "prompt": "the " * (LIMIT // 4 + 1)}
    error = openai_error(post(gateway, "/v1/completions", body), 413)
    assert error["code"] == "body_too_large" and error["param"] == "body"
    assert "--max-body-bytes" in error["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit counts the bytes read
        yield b'{"model": "tiny-gpt2", "prompt": "'
        for _ in range(LIMIT // 1024 + 1):
            yield b"a " * 512
        yield b'"}'

    response = httpx.post(gateway.url + "/v1/completions", content=chunked(),
                          headers={"content-type": "application/json"}, timeout=30)
    assert openai_error(response, 413)["code"] == "body_too_large"
    assert gateway_client.tokenizer.encoded == before
    assert_serves(gateway)


def test_a_body_that_stalls_gets_408(gateway: ThreadedServer) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{gateway.port}\r\n"
                     "content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                     "{\"model\": ".encode())
        chunks = []
        while chunk := sock.recv(65536):  # the gateway closes the connection after the 408
            chunks.append(chunk)
        answer = b"".join(chunks).decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "--body-timeout-s" in answer
    assert_serves(gateway)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_surely_too_long_is_refused_without_tokenizing(
        gateway: ThreadedServer, gateway_client: SpecDecClient, path: str) -> None:
    """The gpt2 pair's context is far below these prompts' non-space characters over the
    longest vocabulary entry, so no tokenizer call is needed to know they do not fit."""
    text = "the cat " * (LIMIT // 10)
    body = ({**CHAT, "messages": [{"role": "user", "content": text}]} if "chat" in path
            else {**COMPLETION, "prompt": text})
    before = gateway_client.tokenizer.encoded
    error = openai_error(post(gateway, path, body), 400)
    assert error["code"] == "context_length_exceeded", error
    assert error["param"] == ("messages" if "chat" in path else "prompt")
    assert gateway_client.tokenizer.encoded == before
    # just over the context by the exact count: tokenized, then refused with the same code
    fits_not = "the " * gateway_client.info.max_context
    body = ({**CHAT, "messages": [{"role": "user", "content": fits_not}]} if "chat" in path
            else {**COMPLETION, "prompt": fits_not})
    error = openai_error(post(gateway, path, body), 400)
    assert error["code"] == "context_length_exceeded"
    assert gateway_client.tokenizer.encoded == before + 1
    assert_serves(gateway)


def test_visible_chars_counts_what_str_split_keeps() -> None:
    assert sorted(WHITESPACE) == [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    for text in ["", "   ", "a b", "\u3000x\u2028y\tz\x85", "the cat " * 50]:
        assert visible_chars(text) == sum(len(word) for word in text.split())


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_memory_comes_back_after_twenty_large_requests(gateway: ThreadedServer) -> None:
    """Bodies just under the limit (refused by the prompt bound) and just over it (413):
    the process's resident memory after 20 of each is within 50 MB of where it was."""
    under = {**COMPLETION, "prompt": "the cat " * (LIMIT // 9)}
    over = {**COMPLETION, "prompt": "a" * (LIMIT + 1)}
    for body, status in ((under, 400), (over, 413)):  # warm up the allocator's arenas
        assert post(gateway, "/v1/completions", body).status_code == status
    before = rss_mb()
    for _ in range(20):
        assert post(gateway, "/v1/completions", under).status_code == 400
        assert post(gateway, "/v1/completions", over).status_code == 413
    assert rss_mb() - before <= 50, (before, rss_mb())
