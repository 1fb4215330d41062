"""What one drafted block did: the one record of a block on the client after its verdict."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """The target's raw log-probability of one output token, and its row's best alternatives
    ((id, log-probability), best first), as the verifier reported them."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class BlockOutcome:
    """What one block did and cost: what ``on_block`` callbacks get, and what the k policy
    learns from (``draft_length.py``)."""

    draft_ids: list[int]  # [k] proposed
    num_accepted: int
    tokens: list[int]  # accepted drafts + the recovered / bonus token, cut after an EOS
    finished: bool  # an EOS token was emitted
    drafting_s: float
    round_trip_s: float  # the verify call's round trip
    # time inside the verifier (queue + forward), part of the round trip; None: not known
    verifier_s: float | None
    depth: int = 0  # draft positions tested: k for a chain, the longest path for a tree
    parents: list[int] | None = None  # a tree's parents (see Draft.parents)
    accepted_path: list[int] | None = None  # a tree's accepted nodes
    drafted_ahead: bool = False  # the draft was made while the previous block was in flight
    # what one drafted token cost the other sessions in the verifier's forward (the reply's
    # StepLoad.draft_price_ms): 0 alone on a verifier, or where a row costs it nothing
    draft_price_s: float = 0.0
    # Set by the policy (``BlockPolicy.observe``): the draft cost nothing to make (a
    # prompt-lookup match sent alone), and the share of drafting_s that fed tokens the drafter
    # had not seen (``DrafterCosts.catch_up_s``), not part of what drafting a token costs
    free: bool = False
    catch_up_s: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens``, when asked

    @property
    def plain_tokens(self) -> int:
        """The tokens a plain run (no drafts) got for its one round trip; 1 for a block."""
        return 1 if self.draft_ids else len(self.tokens)

    def kinds(self) -> list[str]:
        """How each of ``tokens`` came: "accepted" (a draft the target accepted), "recovered"
        (drawn from the residual after a rejection), "bonus" (drawn from the target after all
        drafts passed) or "target" (a plain step: no drafts in the block)."""
        k, accepted = len(self.draft_ids), self.num_accepted
        last = "target" if k == 0 else "bonus" if accepted == k else "recovered"
        return ["accepted" if i < accepted else last for i in range(len(self.tokens))]
