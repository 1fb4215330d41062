"""The speculation policy of one generation, apart from the loop that runs it
(``speculative.py``): before each block it proposes the block's shape (:class:`BlockPlan`: k,
how deep a draft may go, a plain run's length), from the k policy (``draft_length.py``) and what
the drafter knows of its own costs; after it, it learns from the block's :class:`BlockOutcome`.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafter_client.draft_length import DraftLength, Observation
from shared.engines.drafter import Drafter


@dataclass(frozen=True)
class BlockPlan:
    """What the next block is to be."""

    k: int  # drafts asked of the drafter (0: a plain step)
    max_depth: int | None = None  # most tokens a draft may put on one path; None: k (a free
    # draft, a prompt-lookup match, may go deeper than the model would)
    plain_run: int = 0  # with k = 0: more plain steps asked for in the same round trip
    catch_up_s: float = 0.0  # what the drafter must first spend on tokens it has not seen

    @property
    def depth(self) -> int:
        return self.k if self.max_depth is None else self.max_depth


@dataclass(frozen=True)
class BlockOutcome:
    """What one block did: what ``on_block`` callbacks get, and what the policy learns from."""

    draft_ids: list[int]  # [k] proposed
    num_accepted: int
    tokens: list[int]  # accepted drafts + the recovered / bonus token, cut after an EOS
    finished: bool  # an EOS token was emitted
    drafting_s: float
    round_trip_s: float
    verifier_s: float  # time inside the verifier (queue + forward), part of the round trip
    depth: int = 0  # draft positions tested: k for a chain, the longest path for a tree
    parents: list[int] | None = None  # a tree's parents (see Draft.parents)
    accepted_path: list[int] | None = None  # a tree's accepted nodes
    drafted_ahead: bool = False  # the draft was made while the previous block was in flight
    draft_price_s: float = 0.0  # what a drafted token cost the others in the verifier's forward

    def kinds(self) -> list[str]:
        """How each of ``tokens`` came: "accepted" (a draft the target accepted), "recovered"
        (drawn from the residual after a rejection), "bonus" (drawn from the target after all
        drafts passed) or "target" (a plain step: no drafts in the block)."""
        k, accepted = len(self.draft_ids), self.num_accepted
        last = "target" if k == 0 else "bonus" if accepted == k else "recovered"
        return ["accepted" if i < accepted else last for i in range(len(self.tokens))]


class BlockPolicy:
    """Proposes each block of one generation and observes what it did."""

    def __init__(self, schedule: DraftLength, drafter: Drafter, max_context: int,
                 max_draft_tokens: int) -> None:
        self.schedule, self.drafter = schedule, drafter
        self.max_context, self.max_draft_tokens = max_context, max_draft_tokens
        drafter.advise(schedule)  # e.g. free lookup drafts judged by this schedule's costs
        measured = drafter.costs().draft_s_per_token
        if measured is not None:
            schedule.seed_drafting(measured)

    def plan(self, position: int, room: int) -> BlockPlan:
        """The next block at sequence ``position`` with ``room`` tokens left to generate. A
        block yields up to k + 1 tokens and needs position + k <= max_context."""
        max_depth = max(0, min(room - 1, self.max_context - position))
        costs = self.drafter.costs()
        k = min(self.schedule.next_k(costs.catch_up_s, room), max_depth)
        # a plain run asks for at most max_draft_tokens more steps (the verifier's cap)
        run = (self.schedule.plain_run(min(max_depth, self.max_draft_tokens), costs.copy_rate)
               if k == 0 else 0)
        return BlockPlan(k, max_depth, run, costs.catch_up_s)

    def observe(self, plan: BlockPlan, outcome: BlockOutcome) -> None:
        drafted = bool(outcome.draft_ids)
        self.schedule.update(Observation(
            outcome.depth, outcome.num_accepted, outcome.drafting_s, outcome.round_trip_s,
            free=self.drafter.costs().free_draft and not outcome.drafted_ahead,
            plain_tokens=len(outcome.tokens) if not drafted else 1,
            forward_s=outcome.verifier_s, catch_up_s=plan.catch_up_s if drafted else 0.0,
            draft_price_s=outcome.draft_price_s))
