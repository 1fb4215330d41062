"""API keys on the wire: both servers (the verifier, the gateway) take ``Authorization: Bearer
KEY``; the client sends it."""

from __future__ import annotations


def bearer_token(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header value; None for any other value."""
    if authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip()


def bearer_header(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
