"""The speculation policy of one generation, apart from the loop that runs it
(``speculative.py``): before each block it proposes the block's shape (:class:`BlockPlan`: k,
how deep a draft may go, a plain run's length), from the k policy (``draft_length.py``) and what
the drafter knows of its own costs; after it, it learns from the block's :class:`BlockOutcome`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from drafter_client.draft_length import DraftLength
from drafter_client.outcome import BlockOutcome
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
        """The k policy learns from ``outcome``, with what only this policy knows of it: whether
        its draft was free (a prompt-lookup match sent alone, not drafted ahead) and what the
        drafter spent first on tokens it had not seen."""
        drafted = bool(outcome.draft_ids)
        self.schedule.update(dataclasses.replace(
            outcome, free=self.drafter.costs().free_draft and not outcome.drafted_ahead,
            catch_up_s=plan.catch_up_s if drafted else 0.0))
