"""The HTTP limits both servers start from (the verifier's settings and the gateway's default to
these; each can set its own)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are parsed
    body_timeout_s: float = 15.0  # a body must arrive within this, or 408
    header_timeout_s: float = 10.0  # a request head must arrive within this, or 408 and close
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this


HTTP_LIMITS = HttpLimits()
