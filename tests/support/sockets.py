"""Raw sockets for the connection-guard tests of both servers."""

from __future__ import annotations

import socket

STILL_OPEN = b"<still open>"  # appended when the server had not closed within the wait


def read_all(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection, or ``STILL_OPEN`` after
    what came when it was still open after ``timeout_s``."""
    sock.settimeout(timeout_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        chunks.append(STILL_OPEN)
    return b"".join(chunks)
