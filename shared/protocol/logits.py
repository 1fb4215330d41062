"""Logit processing row by row (temperature, top-k, top-p), for ``shared.protocol.sampling`` and the
verifier's batched acceptance; top-p without sorting the vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.protocol.transfer import to_device

if TYPE_CHECKING:
    from shared.protocol.sampling import SamplingConfig

NEG_INF = float("-inf")

NUCLEUS_CANDIDATES = 1024  # top-p looks at the best 1024 tokens first; the rest when needed


def nucleus_drop(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p: [R, vocab] scores, [R] float64 top_p (< 1) -> [R, vocab] True where a token is
    dropped. A token stays while the mass of the better tokens is below top_p (the smallest set
    reaching top_p; always the best token). Sorting a large vocabulary's row is slow on a CPU,
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


def process_rows(logits: torch.Tensor, configs: list[SamplingConfig]) -> torch.Tensor:
    """Raw logits -> processed log-probs with one config per row (none greedy): temperature,
    then top-k, then top-p; ``shared.protocol.sampling.process_logits`` for one config.

    logits: [R, vocab]; configs: [R]. Returns [R, vocab] float32 log-probs, -inf off support.
    A row's answer depends on that row and its config alone, so the verifier's batched
    acceptance matches the host path bit for bit. Which steps run is decided on the host from
    the configs, so nothing waits on the device."""
    device, vocab = logits.device, logits.shape[-1]
    raw = logits.double()  # [R, vocab]
    shifted = raw - raw.max(dim=-1, keepdim=True).values
    temperatures = {c.temperature for c in configs}
    if len(temperatures) == 1:  # one division by a float64 scalar: the same arithmetic
        scores = (shifted / temperatures.pop()).float()  # [R, vocab]
    else:
        temperature = to_device([c.temperature for c in configs], torch.float64, device)
        scores = (shifted / temperature[:, None]).float()
    top_k = [c.top_k if 0 < c.top_k < vocab else 0 for c in configs]  # 0: no top-k
    if len(set(top_k)) == 1 and top_k[0]:
        kth_best = torch.topk(scores, top_k[0], dim=-1).values[..., -1:]  # [R, 1]
        scores = scores.masked_fill(scores < kth_best, NEG_INF)
    elif any(top_k):
        best = torch.topk(scores, max(top_k), dim=-1).values  # [R, widest], descending
        kth = to_device([max(k, 1) - 1 for k in top_k], torch.long, device)  # [R]
        kth_best = best.gather(-1, kth[:, None])  # [R, 1]
        limited = to_device([k > 0 for k in top_k], torch.bool, device)  # [R]
        kth_best = torch.where(limited[:, None], kth_best, NEG_INF)
        scores = scores.masked_fill(scores < kth_best, NEG_INF)
    nucleus = [r for r, c in enumerate(configs) if c.top_p < 1.0]
    if len(nucleus) == len(configs):
        top_p = to_device([c.top_p for c in configs], torch.float64, device)
        scores = scores.masked_fill(nucleus_drop(scores, top_p), NEG_INF)
    elif nucleus:  # only these rows: each row's answer is its own (nucleus_drop)
        rows = to_device(nucleus, torch.long, device)
        top_p = to_device([configs[r].top_p for r in nucleus], torch.float64, device)
        scores = scores.clone()
        scores[rows] = scores[rows].masked_fill(nucleus_drop(scores[rows], top_p), NEG_INF)
    return torch.log_softmax(scores, dim=-1)
