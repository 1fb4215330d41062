"""A body over the limit gets 413 on its Content-Length, and the rest of that body, still
arriving after the answer, is not taken for the next request's head (#57 finding 16: 3 of 8
concurrent 1 MB bodies were answered 431)."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from tests.support.live_server import LiveServer, fp32_settings
from tests.support.sockets import read_all
from verifier_service.settings import Settings

pytest.importorskip("httptools")


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models["gpt2-target"], http_parser="httptools")


def test_the_rest_of_a_refused_body_is_not_a_head(server: LiveServer) -> None:
    size = 1 << 20
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n" % (size + 2))
        sock.sendall(b"[" + b"1," * 8192)  # the start of the body: the 413 goes out now
        sock.settimeout(10)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 413"), first[:200]
        # the rest of the body, which the server may stop reading once it has answered
        with contextlib.suppress(OSError):
            sock.sendall(b"1," * ((size - 2 * 8192) // 2) + b"1]")
        rest = read_all(sock, 3.0)
    assert b"431" not in first + rest, (first + rest)[:400]
