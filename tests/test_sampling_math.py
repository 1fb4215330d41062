"""Unit tests of the sampling math with hand-built logits, one comment per row."""

from __future__ import annotations

import math

import pytest
import torch

from shared.protocol.acceptance import (
    accept_drafts,
    accept_greedy,
    recover_token,
    residual_probs,
    residual_without_token,
    verify_block,
)
from shared.protocol.sampling import SamplingConfig, process_logits, sample_from_probs

NEG = float("-inf")
T1 = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig()


def test_greedy_block_accepts_until_first_mismatch() -> None:
    logits = torch.tensor([
        [10.0, -10, -10, -10],  # argmax 0: accepts draft 0
        [-10, -10, 10, -10],  # argmax 2: rejects draft 1 -> recovered token is 2
        [-10, 10, -10, -10],  # never reached
    ])
    verdict = verify_block(logits, torch.tensor([0, 1]), None, torch.zeros(2), 0.5, GREEDY)
    assert verdict.num_accepted == 1
    assert verdict.next_token == 2
    assert verdict.row is None and verdict.target_logprobs is None


def test_greedy_block_all_accepted_gives_bonus_argmax() -> None:
    logits = torch.tensor([
        [10.0, -10, -10],  # accepts draft 1? no: argmax 0 == draft 0
        [-10, 10, -10],  # argmax 1 == draft 1
        [-10, -10, 10],  # bonus: argmax 2
    ])
    verdict = verify_block(logits, torch.tensor([0, 1]), None, torch.zeros(2), 0.9, GREEDY)
    assert (verdict.num_accepted, verdict.next_token) == (2, 2)


def test_accept_drafts_log_ratio_rule() -> None:
    target_lp = torch.log(torch.tensor([0.5, 0.1, 0.9]))
    draft_lp = torch.log(torch.tensor([0.25, 0.4, 0.9]))
    # ratios p/q = 2 (always accepted), 0.25, 1
    assert accept_drafts(target_lp, draft_lp, torch.log(torch.tensor([0.99, 0.2, 0.5]))) == 3
    assert accept_drafts(target_lp, draft_lp, torch.log(torch.tensor([0.99, 0.3, 0.5]))) == 1
    # u equal to the ratio is a rejection (strict <)
    assert accept_drafts(target_lp, draft_lp, torch.log(torch.tensor([0.5, 0.25, 0.5]))) == 1


def test_one_hot_draft_accepts_with_target_probability() -> None:
    target_lp = torch.log(torch.tensor([0.3]))
    assert accept_drafts(target_lp, None, torch.log(torch.tensor([0.29]))) == 1
    assert accept_drafts(target_lp, None, torch.log(torch.tensor([0.31]))) == 0


def test_accept_greedy() -> None:
    assert accept_greedy(torch.tensor([3, 1, 2]), torch.tensor([3, 1, 0, 5])) == 2
    assert accept_greedy(torch.tensor([3, 1]), torch.tensor([3, 1, 0])) == 2
    assert accept_greedy(torch.tensor([], dtype=torch.long), torch.tensor([4])) == 0


def test_residual_is_normalised_positive_part() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    # max(0, p - q) = [0.4, 0, 0, 0] -> all mass on token 0
    assert torch.allclose(residual_probs(p, q), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    # one-hot draft of token 0: p without token 0, renormalised
    expected = torch.tensor([0.0, 0.6, 0.4, 0.0], dtype=torch.float64)
    assert torch.allclose(residual_without_token(p, 0), expected)


def test_sample_from_probs_inverts_the_cdf_and_skips_zeros() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert sample_from_probs(probs, 0.0) == 1
    assert sample_from_probs(probs, 0.2499) == 1
    assert sample_from_probs(probs, 0.25) == 3
    assert sample_from_probs(probs, 1 - 1e-16) == 3
    assert sample_from_probs(torch.tensor([2.0, 2.0]), 0.6) == 1  # unnormalised weights
    with pytest.raises(ValueError):
        sample_from_probs(torch.zeros(3), 0.5)


def test_top_k_keeps_the_k_best() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    lp = process_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.isinf(lp[0]) and torch.isinf(lp[3])  # dropped
    assert math.isclose(lp[1:3].exp().sum().item(), 1.0, rel_tol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    lp = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    # 0.5 alone < 0.8; 0.5 + 0.3 reaches 0.8 -> keep tokens 0 and 1
    assert torch.isfinite(lp[:2]).all() and torch.isinf(lp[2:]).all()
    lp = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.81))
    assert torch.isfinite(lp[:3]).all() and torch.isinf(lp[3])  # needs the 0.15 token too


def test_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 2.0])
    cold = process_logits(logits, SamplingConfig(temperature=0.5)).exp()
    warm = process_logits(logits, SamplingConfig(temperature=2.0)).exp()
    assert cold[1] > warm[1] > 0.5


def test_greedy_is_not_processed_as_sampling() -> None:
    with pytest.raises(ValueError):
        process_logits(torch.zeros(3), GREEDY)


def test_sampling_block_rejection_sends_target_row() -> None:
    logits = torch.log(torch.tensor([
        [0.1, 0.9],  # p(x_1 = 0) = 0.1 vs q = 0.5: rejected for u = 0.3 (ratio 0.2)
        [0.5, 0.5],  # unused
    ]))
    verdict = verify_block(logits, torch.tensor([0]), torch.log(torch.tensor([0.5])),
                           torch.log(torch.tensor([0.3])), 0.5, T1)
    assert verdict.num_accepted == 0 and verdict.next_token is None
    assert verdict.row is not None and torch.allclose(verdict.row, torch.tensor([0.1, 0.9]))
    # the client then recovers from max(0, p - q) = [0, 0.4] -> token 1
    assert recover_token(verdict.row, torch.tensor([0.5, 0.5]), 0.01) == 1


def test_sampling_block_one_hot_rejection_drawn_by_verifier() -> None:
    logits = torch.log(torch.tensor([
        [0.2, 0.3, 0.5],  # draft 2 with p = 0.5: rejected for u = 0.6
        [1.0, 1.0, 1.0],
    ]))
    verdict = verify_block(logits, torch.tensor([2]), None, torch.log(torch.tensor([0.6])),
                           0.99, T1)
    assert verdict.num_accepted == 0
    assert verdict.next_token == 1  # p without token 2 = [0.4, 0.6]; u = 0.99 -> token 1
    assert verdict.row is None


def test_sampling_block_all_accepted_draws_bonus() -> None:
    logits = torch.log(torch.tensor([
        [0.5, 0.5],  # draft 0: ratio 1 -> accepted
        [0.0, 1.0],  # bonus must be token 1
    ]))
    verdict = verify_block(logits, torch.tensor([0]), torch.log(torch.tensor([0.5])),
                           torch.log(torch.tensor([0.9])), 0.3, T1)
    assert (verdict.num_accepted, verdict.next_token) == (1, 1)


def full_sort_nucleus_drop(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook top-p: sort the whole row, keep while the mass before a token < top_p."""
    probs = torch.softmax(scores.double(), dim=-1)
    order = torch.sort(scores, dim=-1, descending=True).indices
    ranked = probs.gather(-1, order)
    keep_sorted = torch.cumsum(ranked, dim=-1) - ranked < top_p
    keep_sorted[:, 0] = True
    return ~torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("spread", [8.0, 2.0, 0.05])  # peaked: candidates suffice; flat: sort
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.95, 0.999])
def test_nucleus_from_candidates_equals_the_full_sort(spread: float, top_p: float) -> None:
    """The best 1024 tokens first, the whole row only when they hold less than top_p: the same
    tokens kept as sorting the whole 5,000-token row (distinct scores, so no tie order)."""
    gen = torch.Generator().manual_seed(int(spread * 100 + top_p * 1000))
    scores = torch.randn(6, 5000, generator=gen, dtype=torch.float64).float() * spread
    config = SamplingConfig(temperature=1.0, top_p=top_p)
    kept = process_logits(scores, config) > NEG
    assert torch.equal(~kept, full_sort_nucleus_drop(scores, top_p))
    assert kept.sum(-1).min() >= 1
