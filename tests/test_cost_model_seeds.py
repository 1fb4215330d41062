"""The verifier's measured verify costs keep the shape of the cost in k for the whole session.

A client that drafts k = 3 for many blocks measures only k = 3. Longer blocks are then priced
from the verifier's seeded costs (``/v1/info`` ``verify_ms``): the measured k = 3 plus the
seeded difference. The negative control is the same cost model with the seeds' shape taken
away (what it did before): first every longer block looks as cheap as k = 3, so a copy goes
16 tokens long at 60% trust; later the longer ks are forgotten and a copy at 95% trust is cut
to 4 tokens on a verifier whose 16-token block costs under twice a one-token step.
"""

from __future__ import annotations

import pytest

from drafter_client.draft_length import CostModelLength
from tests.support.outcomes import observed

# A cheap-block verifier's verify_ms (the int8 engine's shape on a CPU with VNNI), ms
CHEAP_BLOCKS = [(0, 77.0), (1, 78.0), (2, 80.0), (3, 82.0), (4, 85.0), (6, 90.0), (8, 105.0),
                (12, 120.0), (16, 135.0)]


def after_short_blocks(blocks: int, shape: bool) -> CostModelLength:
    model = CostModelLength(max_k=16, verify_ms=CHEAP_BLOCKS)
    if not shape:
        model._seed = {}  # the negative control: the seeds only as a first measurement
    model.seed_drafting(0.025)
    for _ in range(blocks):
        model.update(observed(proposed=3, accepted=2, drafting_s=0.075, rtt_s=0.090,
                                 forward_s=0.080))
    return model


@pytest.mark.parametrize("blocks", [20, 80])
def test_long_blocks_keep_the_verifiers_price(blocks: int) -> None:
    model = after_short_blocks(blocks, shape=True)
    assert model.rtt(3) == pytest.approx(0.090, abs=5e-4)  # the seed's weight decayed
    assert model.rtt(16) == pytest.approx(model.rtt(3) + 0.135 - 0.082)
    assert model.rtt(10) == pytest.approx(model.rtt(3) + 0.1125 - 0.082)  # between seeded 8 and 12
    assert model.free_k(0.95) >= 12  # a trusted copy goes long where blocks are cheap
    assert 3 <= model.free_k(0.6) <= 6  # an untrusted one does not


@pytest.mark.parametrize("blocks", [20, 80])
def test_without_the_seeds_shape_copies_are_priced_wrong(blocks: int) -> None:
    model = after_short_blocks(blocks, shape=False)
    wrong = model.free_k(0.6) > 6 or model.free_k(0.95) < 12
    assert wrong, (blocks, model.free_k(0.6), model.free_k(0.95))


def test_seeded_costs_interpolate_and_extrapolate() -> None:
    model = CostModelLength(max_k=32, verify_ms=[(1, 10.0), (4, 16.0), (8, 24.0)])
    assert model.seeded(1) == pytest.approx(0.010)
    assert model.seeded(0) == pytest.approx(0.010)  # below the first: the first
    assert model.seeded(2) == pytest.approx(0.012)
    assert model.seeded(12) == pytest.approx(0.032)  # past the last: the last slope
    assert model.longest_known() == 8
