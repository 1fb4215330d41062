"""Sampling parameters at the edges of their float ranges: subnormal, tiny, huge, exactly 1.0
and just below it, for temperature, top-p and top-k, in every mode (property tests).

Semantics: as the temperature goes to 0 the distribution tends to greedy (all mass on the argmax,
shared by exact ties); top-p always keeps at least the most likely token (transformers' warpers
with ``min_tokens_to_keep=1``). Whatever the values, nothing is NaN and a token can be drawn.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol.acceptance import verify_block
from shared.protocol.sampling import SamplingConfig, process_logits, sample_from_probs
from shared.protocol.schema import EncodedRow, SamplingParams, encode_logprobs

VOCAB = 12
TEMPERATURES = [5e-324, 1e-310, 1e-300, 1e-40, 1e-8, 0.25, 0.9999999999999999, 1.0, 7.5, 100.0]
TOP_PS = [5e-324, 1e-300, 1e-50, 1e-8, 0.3, 0.9999999999999999, 1.0]
TOP_KS = [0, 1, 2, VOCAB - 1, VOCAB, 2**31 - 1]
FLOAT_CLASSES = st.one_of(st.sampled_from(TEMPERATURES),
                          st.floats(min_value=5e-324, max_value=100.0, allow_subnormal=True))
P_CLASSES = st.one_of(st.sampled_from(TOP_PS),
                      st.floats(min_value=5e-324, max_value=1.0, allow_subnormal=True))
LOGITS = st.lists(st.floats(min_value=-30.0, max_value=30.0, width=32), min_size=VOCAB,
                  max_size=VOCAB)
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def check_distribution(logprobs: torch.Tensor, logits: torch.Tensor) -> None:
    assert not torch.isnan(logprobs).any(), logprobs
    assert (logprobs <= 1e-6).all()
    probs = logprobs.double().exp()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    best = logits.max()
    top = torch.nonzero(logits == best).flatten()
    assert float(probs[top].sum()) > 0, "the most likely token was dropped"


@PROPERTY
@given(raw=LOGITS, temperature=FLOAT_CLASSES, top_p=P_CLASSES,
       top_k=st.sampled_from(TOP_KS))
def test_process_logits_is_a_distribution_for_every_float_class(
        raw: list[float], temperature: float, top_p: float, top_k: int) -> None:
    logits = torch.tensor(raw)
    config = SamplingConfig(temperature, top_k, top_p)
    logprobs = process_logits(logits, config)
    check_distribution(logprobs, logits)
    token = sample_from_probs(logprobs.exp(), 0.999999)
    assert 0 <= token < VOCAB and logprobs[token] > float("-inf")


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-40])
def test_tiny_temperature_is_greedy_in_the_limit(temperature: float) -> None:
    logits = torch.tensor([[0.5, 2.0, 1.9999, -3.0], [1.0, 4.0, 4.0, 0.0]])  # row 2: a tie
    probs = process_logits(logits, SamplingConfig(temperature)).exp()
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-50, 1e-8])
def test_tiny_top_p_keeps_exactly_the_top_token(top_p: float) -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    for temperature in (1e-40, 0.7, 1.0, 100.0):
        probs = process_logits(logits, SamplingConfig(temperature, 0, top_p)).exp()
        torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_ordinary_values_are_unchanged() -> None:
    """The stable form equals plain softmax(logits / T) with truncation where nothing is tiny."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)):
        ours = process_logits(logits, SamplingConfig(temperature, top_k, top_p)).exp()
        plain = torch.softmax(logits / temperature, dim=-1)
        kept = ours > 0
        if top_k:
            assert (kept.sum(-1) == top_k).all()
        renormalised = plain * kept / (plain * kept).sum(-1, keepdim=True)
        torch.testing.assert_close(ours, renormalised.float(), rtol=1e-5, atol=1e-7)


@PROPERTY
@given(raw=st.lists(LOGITS, min_size=3, max_size=3), temperature=FLOAT_CLASSES,
       top_p=P_CLASSES, top_k=st.sampled_from(TOP_KS),
       mode=st.sampled_from(["sampled", "one-hot"]), uniform=st.floats(0.0, 0.9999999))
def test_verify_block_never_yields_nan_on_the_wire(raw: list[list[float]], temperature: float,
                                                   top_p: float, top_k: int, mode: str,
                                                   uniform: float) -> None:
    logits = torch.tensor(raw)  # [k + 1, vocab], k = 2
    config = SamplingConfig(temperature, top_k, top_p)
    draft_ids = torch.tensor([1, 2])
    draft_lp = None
    if mode == "sampled":  # a drafter with the same processing on shifted logits
        draft_lp = process_logits(logits[:2] * 0.5, config)[torch.arange(2), draft_ids].double()
        if torch.isinf(draft_lp).any():
            return  # a drafter cannot draw a token outside its own support
    verdict = verify_block(logits, draft_ids, draft_lp, torch.log(torch.tensor([0.5, 0.5])),
                           uniform, config)
    assert 0 <= verdict.num_accepted <= 2
    assert verdict.target_logprobs is not None
    assert not torch.isnan(verdict.target_logprobs).any()
    for value in encode_logprobs(verdict.target_logprobs):
        assert value is None or math.isfinite(value)
    if verdict.next_token is not None:
        assert 0 <= verdict.next_token < VOCAB
    else:
        assert verdict.row is not None and not torch.isnan(verdict.row).any()
        decoded = EncodedRow.encode(verdict.row).decode(VOCAB)
        assert math.isclose(float(decoded.sum()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize(("field", "value"), [("temperature", -1.0), ("temperature", 100.5),
                                              ("temperature", float("nan")),
                                              ("temperature", float("inf")),
                                              ("top_p", 0.0), ("top_p", 1.5),
                                              ("top_p", float("nan")), ("top_k", -1)])
def test_values_outside_the_ranges_are_rejected_naming_the_field(field: str,
                                                                 value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
