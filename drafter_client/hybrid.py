"""Hybrid drafting: prompt lookup where the context has a match, the model where it has none.

A prompt-lookup match drafts for free (no forward), and on input-grounded work (edit this code,
summarise this text) it is right for long runs; the model drafter is right more often on fresh
text but costs a drafter forward per token. Every block the lookup proposes (free), and:

* the lookup has a match and is *trusted* - the share of its recent proposals that the target
  went on to output is at least the model's recent share (less ``margin``) and at least
  ``min_trust`` - so the lookup draft goes alone, up to ``lookup_tokens`` long (0: the block's
  k; with ``advisor`` set - the loop sets it to its draft-length policy - the length whose
  expected tokens per second are highest at the lookup's measured trust and this verifier's
  cost per block size, even where k is 0), and the model is not run. Under ``-k auto`` the
  cost model decides the trust too: the match goes alone when that free draft is expected to
  give more tokens per second than the model at its best k;
* otherwise the model drafts. With a model tree (``tree_width`` > 1, greedy) a lookup match
  also rides along as one more branch of the tree.

The lookup's trust is kept per match length (``TRUST_LENGTHS``): a 12-token match of the tail
is copied right far more often than a 1-token one, so a long match can go alone, and long,
where short ones in the same text would not. Each length's record estimates the chance that
each token of its proposals passes (tokens passed and failures seen, decayed per block), and a
length is trusted at least as much as any shorter one. Proposals that were not sent are scored too
(against what was committed), so an untrusted lookup earns trust back without costing a verify
slot.

Where nothing is drafted, the loop asks for plain runs of several steps per round trip, and the
lookup is not consulted inside a run: a copy of the prompt that begins there is found only after
the run. So the hybrid replays each plain run's tokens through the lookup and counts where a
copy began (a match of at least ``COPY_MATCH`` tokens whose proposal the run then output):
:attr:`copy_rate`, per plain token, lets the cost model shorten plain runs where copies begin
often and round trips are cheap.
"""

from __future__ import annotations

import torch

from drafter_client.model_free import PromptLookupDrafter
from shared.engines.drafter import (
    Draft,
    Drafter,
    DrafterCosts,
    FreeDraftAdvice,
    LMDrafter,
    RowShaper,
    TreeBuilder,
    common_prefix,
)
from shared.protocol.sampling import SamplingConfig

SCORE_TOKENS = 2  # the shortest lookup proposal scored in a block (free: no forward)
LOOK_TOKENS = 32  # the longest lookup proposal looked at (what is sent is cut from it)
TRUST_LENGTHS = (1, 2, 3, 4, 8)  # match lengths with a trust of their own: 1, 2, 3, 4-7, 8+
# The lookup's record before any proposal is scored: (tokens passed, failures) = a third. Its
# proposals are scored whether sent or not, so a wary start costs little: one right proposal
# lifts it to two thirds.
LOOKUP_PRIOR = (1.0, 2.0)
COPY_MATCH = 4  # the shortest match of the tail whose proposal counts as a copy in a plain run
COPY_PRIOR = (0.1, 10.0)  # (copies begun, plain tokens) before any plain run was seen


_NO_DRAWS = torch.Generator()  # the lookup draws nothing


def trust_class(matched: int) -> int:
    """The :data:`TRUST_LENGTHS` entry a match of ``matched`` tokens is trusted by."""
    return max((length for length in TRUST_LENGTHS if length <= matched), default=1)


class HybridDrafter(Drafter):
    overlaps = True

    def __init__(self, model: LMDrafter, lookup: PromptLookupDrafter | None = None,
                 lookup_tokens: int = 0, min_trust: float = 0.3, margin: float = 0.1,
                 decay: float = 0.7) -> None:
        self.model = model
        self.lookup = lookup or PromptLookupDrafter()
        self.lookup_tokens, self.min_trust, self.margin, self.decay = (
            lookup_tokens, min_trust, margin, decay)
        self.name = f"{model.name}+lookup"
        # Set by the loop from its draft-length policy: how long a free lookup draft should be
        # at the lookup's trust, and whether it beats the model's best (see DraftLength).
        self.advisor: FreeDraftAdvice | None = None
        self.sent_lookup = False  # the last proposal was a lookup match alone (free)
        self.reset_scores()

    def reset_scores(self) -> None:
        # The lookup's records: [tokens that passed, failures seen], decayed per block, from
        # LOOKUP_PRIOR; a rate estimates the chance that each token of a proposal passes (a run
        # of passes ending at the first failure). One over every proposal, and one per match
        # length once that length has been scored.
        self.lookup_pooled = list(LOOKUP_PRIOR)
        self.lookup_counts: dict[int, list[float]] = {}
        self._class = TRUST_LENGTHS[0]  # the trust class of this block's lookup match
        self.model_score = 0.5  # running share of each model chain the target output
        self._looked: list[int] = []  # this block's lookup proposal (sent or not)
        self._modelled: list[int] = []  # this block's model chain, when the model drafted
        self.copies = list(COPY_PRIOR)  # [copies begun, plain tokens], decayed per plain run
        self._nothing_sent = False  # the last proposal was empty (k = 0, no lookup sent)

    def warm_up(self) -> None:
        self.model.warm_up()

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.model.reset(prompt_ids, encoder_ids)
        self.lookup.reset(prompt_ids, encoder_ids)
        self.reset_scores()

    @property
    def lookup_scores(self) -> dict[int, float]:
        """Per match length scored so far: the estimated chance that each token of its
        proposal passes."""
        return {length: passed / (passed + failed)
                for length, (passed, failed) in self.lookup_counts.items()}

    @property
    def lookup_score(self) -> float:
        """The trust of this block's lookup match: its length's rate (before that length is
        scored, the rate over every proposal), or a scored shorter length's where that is
        higher (a longer match of the tail is copied right at least as often)."""
        passed, failed = self.lookup_counts.get(self._class, self.lookup_pooled)
        shorter = [rate for length, rate in self.lookup_scores.items() if length < self._class]
        return max([passed / (passed + failed), *shorter])

    def trusted(self) -> bool:
        """A lookup match goes alone: the advisor (``-k auto``'s cost model) expects it to
        give more tokens per second than the model; without an opinion, its share of recent
        proposals that the target output is near the model's."""
        if not self._looked:
            return False
        prefers = (self.advisor.prefers_free(self.lookup_score)
                   if self.advisor is not None else None)
        if prefers is not None:
            return prefers
        return (self.lookup_score >= self.min_trust
                and self.lookup_score >= self.model_score - self.margin)

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        # Looked up every block, even when nothing would be sent (k = 0, no free length), so
        # its score keeps following what the target outputs and lost trust can come back.
        looked = self.lookup.propose(max(LOOK_TOKENS, k, self.lookup_tokens), config,
                                     generator).ids
        self._class = trust_class(self.lookup.matched)
        free = (self.advisor.free_k(self.lookup_score)
                if self.advisor is not None and not self.lookup_tokens else None)
        send = max(k, self.lookup_tokens) if free is None else free  # a trusted match's length
        looked = looked[:max(send, k, SCORE_TOKENS)]
        self._looked, self._modelled = looked, []
        self.sent_lookup = send > 0 and self.trusted()
        if self.sent_lookup:
            self._looked = looked[:send]  # scored on what it sent
            return Draft(self._looked, None, None)
        draft = self.model.propose(k, config, generator)
        self._modelled = draft.first_chain()
        self._nothing_sent = not draft.ids  # a plain step (or run) follows
        chain = looked[:max(k, self.lookup_tokens)]
        if not chain or draft.parents is None:
            return draft
        tree = TreeBuilder()  # a model tree: the lookup rides along as one more branch
        tree.add_draft(draft)
        tree.add_path(chain)
        return tree.draft()

    def speculate(self, assumed: list[int], k: int, config: SamplingConfig,
                  generator: torch.Generator) -> tuple[int, Draft] | None:
        """The model's draft for the next block (see :meth:`LMDrafter.speculate`); none after a
        lookup-only block - a lookup draft costs nothing to make when its block comes."""
        if not self._modelled:
            return None
        return self.model.speculate(assumed, k, config, generator)

    def _score(self, score: float, proposal: list[int], tokens: list[int]) -> float:
        kept = common_prefix(proposal, tokens) / len(proposal)
        return self.decay * score + (1 - self.decay) * kept

    def _count(self, proposal: list[int], tokens: list[int]) -> None:
        """Score this block's lookup proposal in its length's record: the tokens that passed,
        and a failure where one was seen (not where the commit ended first: censored)."""
        kept = common_prefix(proposal, tokens)
        failed = kept < min(len(proposal), len(tokens))
        own = self.lookup_counts.setdefault(self._class, list(LOOKUP_PRIOR))
        for record in (self.lookup_pooled, own):
            record[0] = self.decay * record[0] + kept
            record[1] = self.decay * record[1] + failed

    def commit(self, tokens: list[int]) -> None:
        # a block of this drafter's proposing that sent nothing: not one drafted ahead
        plain_run = len(tokens) > 1 and self._nothing_sent
        self._nothing_sent = False
        if self._looked:
            self._count(self._looked, tokens)
        if self._modelled:
            self.model_score = self._score(self.model_score, self._modelled, tokens)
        self._looked, self._modelled = [], []
        self.model.commit(tokens)
        if plain_run:
            self._replay(tokens)
        else:
            self.lookup.commit(tokens)

    def _replay(self, tokens: list[int]) -> None:
        """Commit a plain run's tokens one at a time, counting the places inside it where the
        lookup would have proposed a copy that the run went on to output."""
        begun, copying = 0, False
        for i, token in enumerate(tokens):
            self.lookup.commit([token])
            rest = tokens[i + 1:i + 1 + SCORE_TOKENS]
            if not rest:
                break
            proposal = self.lookup.propose(len(rest), SamplingConfig(), _NO_DRAWS).ids
            copy = self.lookup.matched >= COPY_MATCH and proposal == rest
            begun += copy and not copying
            copying = copy
        self.copies = [self.decay * self.copies[0] + begun,
                       self.decay * self.copies[1] + len(tokens) - 1]

    @property
    def copy_rate(self) -> float:
        """Copies begun inside plain runs per plain token (decayed)."""
        return self.copies[0] / self.copies[1]

    def advise(self, schedule: FreeDraftAdvice) -> None:
        self.advisor = schedule

    def shape(self, shaper: RowShaper | None) -> None:
        self.model.shape(shaper)

    def costs(self) -> DrafterCosts:
        model = self.model.costs()
        return DrafterCosts(model.draft_s_per_token, model.catch_up_s, self.copy_rate,
                            free_draft=self.sent_lookup)

