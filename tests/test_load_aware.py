"""Load-aware speculation: the verifier prices a drafted token by what it costs the other
sessions in the same forward, and ``-k auto`` drafts less when that price is high.

The arithmetic, on a verifier whose forward costs ``m`` per row (a 2-core CPU: no compute to
spare), N sessions, the others plain: a block of k drafts with E expected tokens gives the batch
(N - 1 + E) tokens for N + k rows against N for N, so it raises the batch's tokens per second
only if E > k + 1 - never. The client's rule, E / (rtt(k) + k * price) with price = (N - 1) m,
reaches the same verdict: E / (N (k + 1) m) against 1 / (N m).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from drafter_client.draft_length import CostModelLength
from drafter_client.transport import HttpVerifier
from shared.engines.target import ForwardItem, Step
from shared.protocol.schema import CreateSessionRequest, StepLoad, VerifyRequest
from tests.support.live_server import LiveServer
from tests.support.outcomes import observed
from verifier_service.scheduling.load import RowCosts
from verifier_service.settings import Settings


def decode_steps(*rows: int) -> list[Step]:
    """One verify-like step per session, ``rows`` new tokens each, all rows kept."""
    return [Step(ForwardItem(slot, 10, [1] * n, keep_logits=True))
            for slot, n in enumerate(rows)]


def test_row_costs_fit_the_marginal_row_and_price_the_others() -> None:
    costs = RowCosts()
    assert costs.row_s() == 0.0  # nothing seen: no price
    for rows in ([1], [2, 1], [3, 3, 1], [5], [2, 2, 2, 2]):  # a forward: 20 ms + 40 ms a row
        costs.observe(decode_steps(*rows), 0.020 + 0.040 * sum(rows))
    assert costs.row_s() == pytest.approx(0.040)
    load = costs.load(decode_steps(1, 3, 1), 0.2)
    assert (load.sessions, load.rows) == (3, 5)
    assert load.row_ms == pytest.approx(40.0) and load.draft_price_ms == pytest.approx(80.0)
    assert costs.load(decode_steps(4), 0.18).draft_price_ms == 0.0  # alone: nobody waits


def test_row_costs_leave_prompts_out_and_start_from_the_verify_costs() -> None:
    """A forward that wrote a prompt is not a decode forward's cost; the verify costs timed at
    start (one session, k drafts: k + 1 rows) seed the line until forwards replace them."""
    costs = RowCosts(verify_ms=[(0, 50.0), (4, 250.0), (8, 450.0)])  # 50 ms a row
    assert costs.row_s() == pytest.approx(0.050)
    prompt = Step(ForwardItem(0, 0, [1] * 200, keep_logits=False))
    with_prompt = Step(ForwardItem(1, 199, [1], keep_logits=True),
                       prefill=ForwardItem(1, 0, [1] * 199, keep_logits=False))
    costs.observe([prompt], 3.0)
    costs.observe([with_prompt], 3.0)
    assert costs.row_s() == pytest.approx(0.050)
    for _ in range(300):  # a flat chip (a GPU at small batches): rows cost nothing
        for rows in (1, 5, 9):
            costs.observe(decode_steps(rows), 0.020)
    assert costs.row_s() < 0.002


def test_a_seed_timed_on_a_busy_machine_does_not_overprice_rows() -> None:
    """Verify costs timed while something else ran (300 ms a row) and then steady forwards of
    4 rows at 40 ms a row: the slope leans on the seed (4 rows only), the cap does not."""
    costs = RowCosts(verify_ms=[(0, 110.0), (2, 540.0), (4, 900.0), (8, 1780.0), (16, 4660.0)])
    for _ in range(200):
        costs.observe(decode_steps(1, 1, 1, 1), 0.160)
    assert costs.row_s() == pytest.approx(0.040, rel=0.05)


def blocks(price_s: float) -> CostModelLength:
    """A cost model that saw the same blocks - 90% acceptance, 2 ms a draft, a round trip of
    40 ms a row over 120 ms of other sessions' rows - under a price per drafted token."""
    model = CostModelLength(max_k=8)
    model.update(observed(2, 2, 0.004, 0.5))  # the first block: prefills, not counted
    for _ in range(30):
        for k in (0, 1, 2, 3, 4):
            accepted = k if k < 4 else 3
            model.update(observed(k, accepted, 0.002 * k, 0.160 + 0.040 * k,
                                     draft_price_s=price_s))
    return model


def test_cost_model_drafts_less_when_the_verifier_is_busy() -> None:
    idle, busy = blocks(0.0), blocks(0.120)  # 3 other sessions at 40 ms a row
    assert idle.draft_price() == 0.0 and busy.draft_price() == pytest.approx(0.120, rel=1e-3)
    assert idle.next_k() >= 2  # alone, drafts pay: each row adds a quarter of a round trip
    assert busy.next_k() == 0  # in a busy batch of such rows they cost more than they give
    assert idle.free_k(0.9) and idle.free_k(0.9) >= 2  # a lookup copy: long alone...
    assert busy.free_k(0.9) == 0  # ...none in the busy batch (at 90% it cannot pay)
    assert busy.free_k(0.99) == 0  # a sure copy would only break even: k rows, k tokens


@pytest.fixture(scope="module")
def server_settings(q4k: dict[str, Path]) -> Settings:
    """``server``: the Q4_K_M target on llama.cpp."""
    return Settings(model=str(q4k["target"]), engine="llama-cpp", threads=1,
                    max_draft_tokens=8, max_context=256)  # type: ignore[arg-type]


def test_replies_say_what_their_forward_held(server: LiveServer) -> None:
    """Alone, a reply's forward held its session only, at no price; two sessions sent
    together share forwards, each reply counting both."""
    loads: list[list[StepLoad]] = [[], []]

    def work(j: int, n: int) -> None:
        verifier = HttpVerifier(server.url, timeout_s=60)
        created = verifier.create_session(CreateSessionRequest(prompt_ids=[5, 6, 7, 8, 9, 10]))
        position, last = created.position, 10
        for _ in range(n):
            reply = verifier.verify(created.session_id, VerifyRequest(
                position=position, last_token=last, final_uniform=0.5))
            assert reply.load is not None and reply.next_token is not None
            loads[j].append(reply.load)
            position, last = reply.position, reply.next_token
        verifier.delete_session(created.session_id)

    work(0, 3)
    assert all(load.sessions == 1 and load.draft_price_ms == 0.0 for load in loads[0])
    assert all(load.rows >= 1 and load.step_ms > 0 for load in loads[0])
    loads = [[], []]
    threads = [threading.Thread(target=work, args=(j, 40)) for j in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    shared = [load for mine in loads for load in mine if load.sessions == 2]
    assert shared, "two sessions sending together never shared a forward"
    assert all(load.draft_price_ms == pytest.approx(load.row_ms, abs=1e-3) for load in shared)
