"""Block outcomes as a k policy's tests describe them: how many drafts, accepted, and what the
block cost."""

from __future__ import annotations

from drafter_client.outcome import BlockOutcome


def observed(proposed: int, accepted: int, drafting_s: float, rtt_s: float, *,
             plain_tokens: int = 1, forward_s: float | None = None, free: bool = False,
             catch_up_s: float = 0.0, draft_price_s: float = 0.0) -> BlockOutcome:
    """A chain of ``proposed`` drafts of which ``accepted`` passed (a plain run of
    ``plain_tokens`` where none were proposed), drafted in ``drafting_s`` and verified in a
    round trip of ``rtt_s``, ``forward_s`` of it in the verifier's forward (None: not known)."""
    tokens = [0] * (accepted + 1 if proposed else plain_tokens)
    return BlockOutcome([0] * proposed, accepted, tokens, False, drafting_s, rtt_s, forward_s,
                        depth=proposed, draft_price_s=draft_price_s, free=free,
                        catch_up_s=catch_up_s)
