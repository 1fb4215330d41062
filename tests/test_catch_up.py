"""A model drafter that has fallen behind - after plain steps, after lookup-only blocks, or before
its first draft of the prompt - must feed those tokens before it drafts again. It measures what a
token of such a feed costs (``LMDrafter.catch_up_s``), and the cost model (``-k auto``) weighs
it: a switch to drafting must repay it over the tokens left, and probes (a k = 1 block where
drafting was losing) cost at most ``PROBE_SHARE`` of the time spent in plain steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shared.engines.drafter as drafters
from drafter_client.draft_length import (
    MIN_PROBE_ROOM,
    PLAIN_RUN,
    PROBE_SHARE,
    CostModelLength,
)
from drafter_client.hybrid import HybridDrafter
from shared.engines.drafter import FED_EVERY_BLOCK, MEASURED_FEED, LMDrafter
from shared.protocol.sampling import SamplingConfig
from tests.support.outcomes import observed

STEP = {0: 0.10, 1: 0.13, 2: 0.14, 3: 0.145, 4: 0.15}  # seconds per verify call by k


def losing_policy() -> CostModelLength:
    """Drafting at half a step per token with half the drafts accepted: plain steps win,
    though drafting would pay at 90% acceptance (probes are worth making)."""
    policy = CostModelLength(max_k=4, probe_every=4, max_probe_gap=8,
                             verify_ms=[(k, s * 1e3) for k, s in STEP.items()])
    policy.seed_drafting(0.05)
    for k in (2, 2, 2, 2, 0, 0):
        policy.update(observed(k, k // 2, 0.05 * k, STEP[k]))
    return policy


def run(policy: CostModelLength, steps: int, catch_up_s: float, room: int = 1000) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = policy.next_k(catch_up_s, room)
        chosen.append(k)
        policy.update(observed(k, k // 2, 0.05 * k, STEP[k],
                                  catch_up_s=catch_up_s if k else 0.0))
    return chosen


def test_probes_wait_until_plain_steps_pay_for_a_far_behind_drafters_catch_up() -> None:
    near, far = losing_policy(), losing_policy()
    near_chosen = run(near, 200, catch_up_s=0.0)[1:]  # the first block still trusts the prior
    far_chosen = run(far, 200, catch_up_s=0.4)[1:]  # 4 plain steps' worth to feed first
    assert near.expected_rate(1) < near.plain_rate() and near.could_pay()
    # caught up, a probe costs 0.08 s: at 3% of 0.1 s per plain step, one per ~27 steps
    near_probes = [i for i, k in enumerate(near_chosen) if k]
    assert 6 <= len(near_probes) <= 8 and {near_chosen[i] for i in near_probes} == {1}
    # 0.48 s per probe: one per ~160 steps
    far_probes = [i for i, k in enumerate(far_chosen) if k]
    assert len(far_probes) == 1 and far_probes[0] >= 140
    for policy in (near, far):
        assert policy.probe_s <= PROBE_SHARE * policy.plain_s
    # drafting's per-token cost is not inflated by the catch-ups (0.4 s each)
    assert far.draft_s_per_token == pytest.approx(0.05)
    waiting = losing_policy()
    run(waiting, 50, catch_up_s=0.4)
    assert waiting.next_k(0.4, 1000) == 0 and waiting.probe_waits
    assert waiting.plain_run(100) == PLAIN_RUN  # runs are not cut for a probe that must wait
    ending = losing_policy()
    assert run(ending, 40, catch_up_s=0.0, room=MIN_PROBE_ROOM - 1)[1:].count(1) == 0


def test_a_switch_to_drafting_must_repay_the_catch_up_over_the_tokens_left() -> None:
    policy = CostModelLength(max_k=4, verify_ms=[(k, s * 1e3) for k, s in STEP.items()])
    policy.seed_drafting(0.01)
    for k in (2, 2, 2, 0):
        policy.update(observed(k, k, 0.01 * k, STEP[k]))  # every draft accepted: drafting wins
    best = max(range(1, 5), key=policy.expected_rate)
    saved = 1 / policy.plain_rate() - 1 / policy.expected_rate(best)
    assert saved > 0
    assert policy.next_k(catch_up_s=0.0, room=10) > 0
    assert policy.next_k(catch_up_s=saved * 10 * 1.1, room=10) == 0  # would not repay
    assert policy.next_k(catch_up_s=saved * 10 * 1.1, room=12) > 0  # repays over 12 tokens


class CountingDrafter(LMDrafter):
    """Drafts token 7 at a fake cost: each forward takes 5 ms plus 1 ms per token fed."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(vocab_size=16)
        self.clock = clock

    def _forward(self, ids: list[int]) -> torch.Tensor:
        if ids:
            self.clock[0] += 0.005 + 0.001 * len(ids)
            self.cached.extend(ids)
            self.last_logits = torch.zeros(16)
            self.last_logits[7] = 1.0
        return self.last_logits

    def _roll_back(self, keep: int) -> None:
        pass


def test_the_model_drafter_measures_its_catch_up(monkeypatch: Any) -> None:
    clock = [0.0]
    monkeypatch.setattr(drafters.time, "perf_counter", lambda: clock[0])
    model = CountingDrafter(clock)
    hybrid = HybridDrafter(model)
    assert model.catch_up_s == 0.0  # nothing measured yet
    model.warm_up()  # its 48-token prefill is timed
    assert model.measured_feed_s == pytest.approx((0.005 + 0.048) / 48)
    hybrid.reset(list(range(1, 11)) * 4)  # a 40-token prompt not yet fed
    assert model.behind == 40
    expected = (40 - FED_EVERY_BLOCK) * model.measured_feed_s
    assert hybrid.costs().catch_up_s == pytest.approx(expected)
    hybrid.propose(2, SamplingConfig(), torch.Generator())
    assert model.measured_feed_s == pytest.approx(0.045 / 40)  # this context's own feed
    hybrid.commit([7, 7, 3])
    assert model.behind == FED_EVERY_BLOCK and model.catch_up_s == 0.0  # a usual block
    hybrid.commit(list(range(MEASURED_FEED - FED_EVERY_BLOCK - 1)))  # too short to time
    before = model.measured_feed_s
    model.propose(1, SamplingConfig(), torch.Generator())
    assert model.measured_feed_s == before
