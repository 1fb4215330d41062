"""Predicted Outputs (OpenAI's ``prediction``): draft from text the answer will mostly repeat.

A caller who asks for an edited file knows most of the answer already: the file. The
:class:`PredictionDrafter` follows the answer through the prediction with a cursor: while the
committed tokens are the prediction's next ones, its next tokens are the draft (free: no
forward); where the answer leaves the prediction (the edited line), the usual drafter drafts,
and once the answer's last ``REALIGN_TOKENS`` tokens occur in the prediction again (the edit
is over) the cursor moves to the first such place at or after where it was, else the first
anywhere. The verifier decides every token as for any draft, so the answer is the target's
whatever the prediction says; a wrong prediction costs rejected drafts, never output.

Counts, as ``usage.completion_tokens_details``: ``accepted`` - drafted prediction tokens the
target accepted; ``rejected`` - drafted prediction tokens the target rejected (scored by the
verifier and thrown away). Prediction tokens never drafted (after the answer left them) are
neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engines.drafter import (
    Draft,
    Drafter,
    DrafterCosts,
    FreeDraftAdvice,
    RowShaper,
    common_prefix,
)
from shared.protocol.sampling import SamplingConfig

PREDICTION_TOKENS = 64  # the longest prediction draft (the verifier's max_draft_tokens cuts it)
REALIGN_TOKENS = 4  # the answer's tail that must match the prediction to follow it again


@dataclass
class PredictionCounts:
    accepted: int = 0
    rejected: int = 0


class PredictionDrafter(Drafter):
    """``prediction`` (token ids) first, ``inner`` where the answer has left it."""

    def __init__(self, inner: Drafter, prediction: list[int]) -> None:
        self.inner, self.prediction = inner, list(prediction)
        self.name = f"prediction+{inner.name}"
        self.top_k_filler = inner.top_k_filler
        self.overlaps = inner.overlaps
        self.counts = PredictionCounts()
        self.cursor: int | None = 0  # the prediction's index of the answer's next token
        self.generated: list[int] = []
        self._sent: list[int] = []  # this block's prediction draft
        self._places: dict[int, list[int]] = {}  # token -> its indices in the prediction
        for index, token in enumerate(self.prediction):
            self._places.setdefault(token, []).append(index)

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.inner.reset(prompt_ids, encoder_ids)
        self.counts, self.cursor, self.generated, self._sent = PredictionCounts(), 0, [], []

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        if self.cursor is not None and self.cursor < len(self.prediction):
            self._sent = self.prediction[self.cursor:self.cursor + max(k, PREDICTION_TOKENS)]
            return Draft(list(self._sent), None, None)
        self._sent = []
        return self.inner.propose(k, config, generator)

    def commit(self, tokens: list[int]) -> None:
        if self._sent:
            kept = common_prefix(self._sent, tokens)
            self.counts.accepted += kept
            # drafts after an EOS the block ended at were accepted, not rejected
            self.counts.rejected += len(self._sent) - kept if kept < len(tokens) else 0
        self._sent = []
        self.inner.commit(tokens)
        self.generated.extend(tokens)
        self._follow(tokens)

    def _follow(self, tokens: list[int]) -> None:
        """Move the cursor past ``tokens`` where the prediction has them next, else realign."""
        at = self.cursor
        if at is not None and self.prediction[at:at + len(tokens)] == tokens:
            self.cursor = at + len(tokens)
            return
        tail = self.generated[-REALIGN_TOKENS:]
        if len(tail) < REALIGN_TOKENS:
            self.cursor = None
            return
        start = at if at is not None else 0
        places = [i for i in self._places.get(tail[0], [])
                  if self.prediction[i:i + len(tail)] == tail]
        later = [i for i in places if i >= start - len(tail)]
        found = later or places
        self.cursor = found[0] + len(tail) if found else None

    def observe_top_k(self, context: list[int], top_ids: list[int]) -> None:
        self.inner.observe_top_k(context, top_ids)

    def speculate(self, assumed: list[int], k: int, config: SamplingConfig,
                  generator: torch.Generator) -> tuple[int, Draft] | None:
        # a prediction draft costs nothing when its block comes: nothing to draft ahead
        return None if self._following() else self.inner.speculate(assumed, k, config,
                                                                    generator)

    def _following(self) -> bool:
        return self.cursor is not None and self.cursor < len(self.prediction)

    def advise(self, schedule: FreeDraftAdvice) -> None:
        self.inner.advise(schedule)

    def shape(self, shaper: RowShaper | None) -> None:
        self.inner.shape(shaper)

    def costs(self) -> DrafterCosts:
        inner = self.inner.costs()
        if not self._following():
            return inner
        return DrafterCosts(inner.draft_s_per_token, inner.catch_up_s, inner.copy_rate,
                            free_draft=True)
