"""What OpenAI's ``logprobs`` report, computed where a block is decided: the target's raw
log-probabilities (log-softmax of its logits, before penalties, a grammar's mask, temperature,
top-k and top-p) of a block's output tokens and of their rows' best alternatives. The verifier
computes them only for a block that asks (``Block.logprobs``), in ``acceptance.decide``, from
the rows it decided the block with."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from shared.protocol.transfer import to_device

if TYPE_CHECKING:
    from shared.protocol.acceptance import Block, Verdict


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's raw log-probabilities (log-softmax of its logits, before temperature,
    top-k, top-p: what OpenAI's ``logprobs`` report) at one output token's row.

    ``logprob``: of the token, when the verifier knows it; a token the client draws itself
    (a model draft's recovered token) has None, and ``support`` holds (ids, log-probabilities)
    of every id it can be (the processed row's support). ``top``: the row's best
    (id, log-probability) pairs, best first."""

    logprob: float | None
    top: list[tuple[int, float]]
    support: tuple[list[int], list[float]] | None = None

    def of(self, token: int) -> float:
        """The token's log-probability."""
        if self.logprob is not None:
            return self.logprob
        if self.support is not None and token in self.support[0]:
            return self.support[1][self.support[0].index(token)]
        raise ValueError(f"no log-probability for token {token} at this row")


def output_logprobs(rows: torch.Tensor, block: Block, verdict: Verdict) -> list[TokenLogprobs]:
    """The raw log-probabilities of the block's output tokens (the accepted drafts, then the
    recovered or bonus token) and their rows' best ``block.logprobs`` ids: rows [n, vocab]
    logits where the forward left them. Row by row in float32, as a one-token step's row."""
    path = verdict.path if verdict.path is not None else list(range(verdict.num_accepted))
    scored = [0, *(node + 1 for node in path)]  # row 0 follows the root, row i + 1 node i
    tokens = [block.draft_ids[node] for node in path] + [verdict.next_token]
    logprobs = torch.log_softmax(rows[scored].float(), dim=-1)  # [m, vocab]
    known = to_device([t if t is not None else 0 for t in tokens], torch.long, rows.device)
    chosen = logprobs.gather(-1, known[:, None])[:, 0].cpu().tolist()  # [m]
    n = min(block.logprobs or 0, rows.shape[-1])
    best = torch.topk(logprobs, n, dim=-1) if n else None
    top_values = best.values.cpu().tolist() if best is not None else [[]] * len(scored)
    top_ids = best.indices.cpu().tolist() if best is not None else [[]] * len(scored)
    out = [TokenLogprobs(lp, list(zip(ids, values, strict=True)))
           for lp, ids, values in zip(chosen, top_ids, top_values, strict=True)]
    if verdict.next_token is None and verdict.row is not None:  # the client draws it
        support = torch.nonzero(verdict.row > 0).flatten()
        values = logprobs[-1].cpu()[support]
        out[-1] = replace(out[-1], logprob=None,
                          support=(support.tolist(), values.tolist()))
    return out
