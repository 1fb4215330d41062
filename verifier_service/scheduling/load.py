"""What one more row costs a batched forward, learnt from the forwards the verifier runs.

A forward over R rows (new tokens, all sessions together) takes about ``a + b R`` seconds: ``b``
is near zero where the chip has compute to spare (a GPU at small batches) and near a whole
one-token step where it has none (a 2-core CPU). Every session in a forward waits for all of
its rows, so a block's k drafts delay the others by ``k b`` each: :class:`RowCosts` fits ``b``
over recent decode forwards (decayed least squares, seeded with the verify costs timed at start)
and prices each forward's drafts in a :class:`StepLoad` that goes back with every verdict.
"""

from __future__ import annotations

import math

from shared.engines.target import Step
from shared.protocol.schema import StepLoad


class RowCosts:
    """Decayed least squares of a forward's seconds against its rows."""

    def __init__(self, verify_ms: list[tuple[int, float]] | None = None,
                 decay: float = 0.98) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # decayed n, sum x, sum x^2, sum y, sum x y
        self._per_row = [0.0, 0.0]  # decayed (weight, sum of seconds / rows)
        for k, ms in verify_ms or []:  # a verify of k drafts: k + 1 rows
            if k >= 0 and math.isfinite(ms) and ms > 0:  # the engines check theirs; kept safe
                self._add(k + 1.0, ms / 1e3, weight=0.5)

    def _add(self, rows: float, seconds: float, weight: float = 1.0) -> None:
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self._sums[i] += weight * v
        self._per_row[0] += weight
        self._per_row[1] += weight * seconds / rows

    def observe(self, steps: list[Step], seconds: float) -> None:
        """A forward ran ``steps`` in ``seconds``. Forwards that wrote a prompt are left out:
        a prompt's tokens cost less each than a block's rows."""
        if not steps or any(not _decode_only(step) for step in steps):
            return
        self._sums = [self.decay * v for v in self._sums]
        self._per_row = [self.decay * v for v in self._per_row]
        self._add(float(sum(len(step.item.token_ids) for step in steps)), seconds)

    def row_s(self) -> float:
        """Seconds one more row adds to a forward (0 where it is not known yet): the line's
        slope, at most the mean seconds per row of the same forwards (a forward's fixed cost
        is not negative). Under steady load the forwards' row counts barely vary and the slope
        leans on the seed; the cap keeps a seed timed on a busy machine from pricing a row
        above what rows cost now."""
        n, sx, sxx, sy, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 1e-9:
            return 0.0
        weight, per_row = self._per_row
        return min(max((n * sxy - sx * sy) / spread, 0.0), per_row / weight)

    def load(self, steps: list[Step], seconds: float) -> StepLoad:
        """What a forward of ``steps`` that took ``seconds`` tells each of its sessions."""
        row_ms = 1e3 * self.row_s()
        rows = sum(len(step.item.token_ids) + (len(step.prefill.token_ids) if step.prefill
                                               else 0) for step in steps)
        return StepLoad(sessions=len(steps), rows=rows, step_ms=round(1e3 * seconds, 3),
                        row_ms=round(row_ms, 4),
                        draft_price_ms=round(max(len(steps) - 1, 0) * row_ms, 4))


def _decode_only(step: Step) -> bool:
    """A step whose every token asks for its row: a verify block or a plain step."""
    item = step.item
    return step.prefill is None and item.keep_logits and item.keep_from == 0 \
        and item.encoder_ids is None
