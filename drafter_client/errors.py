"""The client's error types and the check of a verifier URL: light (httpx only), so the
command line reports a bad URL before it loads torch."""

from __future__ import annotations

from typing import Any

import httpx


class SpecDecError(RuntimeError):
    """An error the client cannot recover from; the message is one line for the user.
    ``partial``: what was generated before it (a GenerationResult), when anything was."""

    partial: Any = None


class GrammarRefused(SpecDecError):
    """The generation's grammar cannot go on (no token of the vocabulary continues it, or
    llguidance gave up on it): what the request asked for, not a failure of the verifier."""


def checked_url(url: str) -> str:
    """The verifier's base URL without a trailing slash; SpecDecError naming what is wrong
    with one that httpx cannot use."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise SpecDecError(f"the verifier URL {url!r} is not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SpecDecError(f"the verifier URL {url!r} needs http:// or https:// and a host "
                           "(e.g. http://127.0.0.1:8000)")
    return url.rstrip("/")
