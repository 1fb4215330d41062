"""Top-p (nucleus) truncation without sorting the vocabulary, for ``shared.sampling``."""

from __future__ import annotations

import torch

NUCLEUS_CANDIDATES = 1024  # top-p looks at the best 1024 tokens first; the rest when needed


def nucleus_drop(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p: [R, vocab] scores, [R] float64 top_p (< 1) -> [R, vocab] True where a token is
    dropped. A token stays while the mass of the better tokens is below top_p (the smallest set
    reaching top_p; always the best token). Sorting a 151,936-token row costs ~15 ms on a CPU,
    so the best ``NUCLEUS_CANDIDATES`` come first; only rows where they hold less than top_p are
    sorted whole. A row's answer depends on that row alone (the batched acceptance needs it)."""
    probs = torch.softmax(scores.double(), dim=-1)  # [R, vocab]
    top_p = top_p[:, None]  # [R, 1]
    best = torch.topk(scores, min(NUCLEUS_CANDIDATES, scores.shape[-1]), dim=-1).indices
    keep, held = _keep_while_below(probs, best, top_p)
    short = (held < top_p[:, 0]).nonzero().flatten()  # [S] rows the candidates do not cover
    if len(short):
        order = torch.sort(scores[short], dim=-1, descending=True).indices  # [S, vocab]
        keep[short] = _keep_while_below(probs[short], order, top_p[short])[0]
    return ~keep


def _keep_while_below(probs: torch.Tensor, order: torch.Tensor,
                      top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """order: [R, n] ids, best first. ([R, vocab] kept, [R] mass of the n)."""
    ranked = probs.gather(-1, order)  # [R, n]
    mass_before = torch.cumsum(ranked, dim=-1) - ranked  # mass of the better tokens
    keep_sorted = mass_before < top_p
    keep_sorted[:, 0] = True  # the best token always stays
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
    return keep, mass_before[:, -1] + ranked[:, -1]
