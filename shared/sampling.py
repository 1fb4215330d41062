"""Sampling math for exact speculative decoding: pure functions of tensors and explicit randomness.

Glossary (as in vLLM's rejection sampler):
  * target distribution p: the target model's processed distribution at a position;
  * draft distribution q: the drafter's processed distribution at the same position;
  * **accepted** tokens: draft tokens that passed the ratio test ``log u < log p(x) - log q(x)``;
  * **recovered** token: drawn from ``norm(max(0, p - q))`` at the first rejected position;
  * **bonus** token: drawn from the target row after the last draft when every draft was accepted;
  * output tokens of a block = accepted + (recovered or bonus), so between 1 and k + 1.

Greedy decoding (temperature 0) is its own path: a draft is accepted while it equals the target's
argmax, and the recovered / bonus token is the argmax.

Deterministic drafts (n-gram, prompt lookup) have a one-hot q: the ratio test becomes
``log u < log p(x)`` and the residual is p with x removed, renormalised.

Randomness never comes from a global RNG: callers pass uniforms drawn from their own
``torch.Generator``; :func:`sample_from_probs` inverts the CDF with one uniform, so the server can
sample on the client's behalf with the client's randomness and get the client's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingConfig:
    """Logit processing applied to both the target and the draft distributions.

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean "no truncation".
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Raw logits -> processed log-probs (temperature, then top-k, then top-p); -inf off support.

    logits: [..., vocab]. Returns float32 log-probs of the same shape. Not for greedy decoding.

    Every temperature > 0 is exact, down to the smallest subnormal: the logits are shifted by
    their maximum before the division (in float64), so the best token scores 0 and the others
    fall towards -inf - the limit as the temperature goes to 0 is greedy (the argmax, exact ties
    sharing), with no overflow and no NaN. top-p always keeps the most likely token
    (transformers' ``min_tokens_to_keep=1``), however small p is.
    """
    if config.greedy:
        raise ValueError("process_logits is for sampling; greedy decoding takes the argmax")
    raw = logits.double()  # [..., vocab]
    shifted = raw - raw.max(dim=-1, keepdim=True).values  # [..., vocab], <= 0, max exactly 0
    scores = (shifted / config.temperature).float()  # [..., vocab]; -inf where it underflows
    vocab = scores.shape[-1]
    if 0 < config.top_k < vocab:
        kth_best = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_best, NEG_INF)
    if config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [..., vocab]
        sorted_probs = torch.softmax(sorted_scores.double(), dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of better tokens
        drop_sorted = mass_before >= config.top_p  # keeps the smallest set reaching top_p
        drop_sorted[..., 0] = False  # and always the best token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, NEG_INF)
    return torch.log_softmax(scores, dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] argmax ids (the lowest id wins a tie)."""
    return torch.argmax(logits, dim=-1)


def draw_uniforms(generator: torch.Generator, count: int) -> torch.Tensor:
    """[count] float64 uniforms in [0, 1) from an explicit generator."""
    return torch.rand(count, generator=generator, dtype=torch.float64)


def sample_from_probs(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF sample of one id from ``probs`` ([vocab], need not sum to 1) with ``uniform``.

    Zero-probability ids are never returned.
    """
    weights = probs.double().clamp_min(0.0)  # [vocab]
    cdf = torch.cumsum(weights, dim=0)  # [vocab]
    total = cdf[-1].item()
    if not total > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    x = torch.tensor([uniform * total], dtype=cdf.dtype)
    index = int(torch.searchsorted(cdf, x, right=True).item())  # first id with cdf > x
    if index >= len(cdf):  # uniform * total rounded up to the total: take the last supported id
        index = int(torch.nonzero(weights > 0).flatten()[-1].item())
    return index


def accept_drafts(
    target_logprobs: torch.Tensor,  # [k] log p_i(x_i)
    draft_logprobs: torch.Tensor | None,  # [k] log q_i(x_i); None for one-hot drafts
    log_uniforms: torch.Tensor,  # [k] log u_i
) -> int:
    """Number of leading drafts that pass ``log u_i < log p_i(x_i) - log q_i(x_i)``."""
    ratio = target_logprobs.double()
    if draft_logprobs is not None:
        ratio = ratio - draft_logprobs.double()
    passed = log_uniforms.double() < ratio  # [k]
    rejected = torch.nonzero(~passed)
    return int(rejected[0].item()) if len(rejected) else len(passed)


def accept_greedy(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> int:
    """Leading drafts equal to the target argmax. draft_ids: [k]; target_argmax: [>= k]."""
    k = draft_ids.shape[0]
    mismatch = torch.nonzero(draft_ids != target_argmax[:k])
    return int(mismatch[0].item()) if len(mismatch) else k


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over [vocab]; the recovered token's distribution.

    If p <= q everywhere (only possible through rounding, since a rejection needs p(x) < q(x)
    somewhere), p itself is returned, which is then the correct conditional.
    """
    residual = (target_probs.double() - draft_probs.double()).clamp_min(0.0)  # [vocab]
    total = residual.sum()
    if not total > 0.0:
        return target_probs.double() / target_probs.double().sum()
    return residual / total


def residual_without_token(target_probs: torch.Tensor, token: int) -> torch.Tensor:
    """Residual for a one-hot draft: p with ``token`` removed, renormalised. [vocab] -> [vocab]."""
    one_hot = torch.zeros_like(target_probs, dtype=torch.float64)
    one_hot[token] = 1.0
    return residual_probs(target_probs, one_hot)


@dataclass(frozen=True)
class BlockVerdict:
    """The verifier's reading of one drafted block.

    num_accepted: leading drafts accepted. next_token: the recovered or bonus token when it could
    be drawn without the draft distribution (greedy, one-hot drafts, or all accepted); otherwise
    None, and ``row`` holds the target's processed probs at the rejected position ([vocab]).
    """

    num_accepted: int
    target_logprobs: torch.Tensor | None  # [k] processed log p_i(x_i); None in greedy mode
    target_argmax: torch.Tensor | None  # [k + 1]; greedy mode only
    next_token: int | None
    row: torch.Tensor | None  # [vocab] probs at the rejected position, for the client's residual


def verify_block(
    target_logits: torch.Tensor,  # [k + 1, vocab] raw logits over [last token, x_1 .. x_k]
    draft_ids: torch.Tensor,  # [k]
    draft_logprobs: torch.Tensor | None,  # [k]; None for one-hot drafts
    log_uniforms: torch.Tensor,  # [k]
    final_uniform: float,
    config: SamplingConfig,
) -> BlockVerdict:
    """The verifier's half of a speculative step: find the first rejection, draw what it can."""
    k = draft_ids.shape[0]
    if config.greedy:
        argmax = greedy_tokens(target_logits)  # [k + 1]
        accepted = accept_greedy(draft_ids, argmax)
        return BlockVerdict(accepted, None, argmax, int(argmax[accepted].item()), None)

    logprobs = process_logits(target_logits, config)  # [k + 1, vocab]
    target_lp = logprobs[torch.arange(k), draft_ids]  # [k] log p_i(x_i)
    accepted = accept_drafts(target_lp, draft_logprobs, log_uniforms)
    probs = logprobs[accepted].exp()  # [vocab] target row at the stopping position
    if accepted == k:  # every draft accepted: bonus token from p_{k+1}
        next_token: int | None = sample_from_probs(probs, final_uniform)
        row = None
    elif draft_logprobs is None:  # one-hot draft rejected: recovered from p without the draft
        next_token = sample_from_probs(
            residual_without_token(probs, int(draft_ids[accepted].item())), final_uniform
        )
        row = None
    else:  # the residual needs q_j, which only the client has: send p_j
        next_token, row = None, probs
    return BlockVerdict(accepted, target_lp, None, next_token, row)


def recover_token(
    target_row: torch.Tensor,  # [vocab] processed target probs p_j
    draft_row: torch.Tensor,  # [vocab] processed draft probs q_j
    final_uniform: float,
) -> int:
    """The client's half after a rejection: recovered token from norm(max(0, p_j - q_j))."""
    return sample_from_probs(residual_probs(target_row, draft_row), final_uniform)
