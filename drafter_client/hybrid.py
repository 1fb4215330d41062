"""Hybrid drafting: prompt lookup where the context has a match, the model where it has none.

A prompt-lookup match drafts for free (no forward), and on input-grounded work (edit this code,
summarise this text) it is right for long runs; the model drafter is right more often on fresh
text but costs a drafter forward per token. Per block:

* the lookup has a match and has been *trusted* (its recent drafts mostly committed): the lookup
  draft alone, up to ``lookup_tokens`` long (0: the block's k, so ``-k auto`` sizes it by what
  a verify of that length costs) - the model is not run;
* otherwise the model drafts; in greedy mode, and whenever the model drafts one-hot trees, a
  lookup match rides along as a second branch of a token tree (verifying it costs next to
  nothing), which is also how an untrusted lookup earns trust back. Under sampling a model chain
  carries its q, and a tree's drafts must be one-hot, so there the lookup only drafts when
  trusted.

Trust is a running mean of the fraction of each lookup draft that was committed.
"""

from __future__ import annotations

import torch

from drafter_client.drafters import Draft, HFDrafter, TreeBuilder, common_prefix
from drafter_client.model_free import PromptLookupDrafter
from shared.sampling import SamplingConfig


class HybridDrafter:
    top_k_filler = 0

    def __init__(self, model: HFDrafter, lookup: PromptLookupDrafter | None = None,
                 lookup_tokens: int = 0, trust_threshold: float = 0.5,
                 decay: float = 0.7) -> None:
        self.model = model
        self.lookup = lookup or PromptLookupDrafter(1, 3)
        self.lookup_tokens, self.trust_threshold, self.decay = (lookup_tokens, trust_threshold,
                                                                decay)
        self.name = f"{model.name}+lookup"
        self.trust = trust_threshold  # start trusting, so the first match is tried alone
        self._looked: list[int] = []  # the lookup draft of the block in flight
        self._committed_before = 0
        self.lookup_blocks = 0  # blocks drafted by the lookup alone (for metrics and tests)

    def warm_up(self) -> None:
        self.model.warm_up()

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.model.reset(prompt_ids, encoder_ids)
        self.lookup.reset(prompt_ids, encoder_ids)
        self.trust, self._looked = self.trust_threshold, []

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        looked = (self.lookup.propose(max(k, self.lookup_tokens), config, generator).ids
                  if k > 0 else [])
        self._looked = looked
        if looked and self.trust >= self.trust_threshold:
            self.lookup_blocks += 1
            return Draft(looked, None, None)
        draft = self.model.propose(k, config, generator)
        if not looked or not (config.deterministic or draft.parents is not None):
            return draft
        tree = TreeBuilder()
        tree.add_draft(draft)
        tree.add_path(looked)
        return tree.draft()

    def speculate(self, assumed: list[int], k: int, config: SamplingConfig,
                  generator: torch.Generator) -> tuple[int, Draft] | None:
        """The model's draft for the next block (see :meth:`HFDrafter.speculate`); none after a
        lookup-only block - a lookup draft costs nothing to make when its block comes."""
        if self._looked and self.trust >= self.trust_threshold:
            return None
        return self.model.speculate(assumed, k, config, generator)

    def commit(self, tokens: list[int]) -> None:
        if self._looked:
            kept = common_prefix(self._looked, tokens) / len(self._looked)
            self.trust = self.decay * self.trust + (1 - self.decay) * kept
            self._looked = []
        self.model.commit(tokens)
        self.lookup.commit(tokens)

    def observe_top_k(self, context: list[int], top_ids: list[int]) -> None:
        pass
