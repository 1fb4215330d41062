"""Generation metrics on a hand-built run, with vLLM's definitions (drafter_client/metrics.py)."""

from __future__ import annotations

import pytest

from drafter_client.metrics import GenerationMetrics, MetricsRecorder


def test_per_position_acceptance_divides_by_drafts() -> None:
    m = GenerationMetrics()
    m.record_block(4, 4)  # all four accepted (+ bonus)
    m.record_block(4, 1)  # x1 accepted, x2 rejected
    m.record_block(2, 2)  # a shorter draft (auto k / confidence stop), both accepted
    m.record_block(0, 0)  # no draft: a plain target step, not a draft
    m.new_tokens = 5 + 2 + 3 + 1
    assert m.verify_calls == 4 and m.drafts == 3
    # position 1: accepted in blocks 1, 2, 3; position 2: blocks 1, 3; positions 3, 4: block 1.
    assert m.per_position_acceptance() == pytest.approx([3 / 3, 2 / 3, 1 / 3, 1 / 3])
    d = m.to_dict()
    assert d["acceptance_rate"] == pytest.approx(7 / 10)
    assert d["mean_tokens_per_call"] == pytest.approx(11 / 4)
    # Its sum + 1 is the mean acceptance length over drafts: (5 + 2 + 3) / 3.
    assert 1 + sum(m.per_position_acceptance()) == pytest.approx(10 / 3)


def test_no_drafts_no_positions() -> None:
    m = GenerationMetrics()
    m.record_block(0, 0)
    assert m.per_position_acceptance() == [] and m.to_dict()["acceptance_rate"] == 0.0


class Counters:
    bytes_sent = 100
    bytes_received = 1000
    retries = 2


def test_recorder_counts_this_generation_only() -> None:
    transport = Counters()
    recorder = MetricsRecorder(transport)
    transport.bytes_sent, transport.bytes_received, transport.retries = 160, 1400, 3
    recorder.block([5, 6], 1, drafting_s=0.01, round_trip_s=0.02, verifier_s=0.015)
    m = recorder.finish(new_tokens=2, session_reopens=1)
    assert (m.bytes_sent, m.bytes_received, m.retries) == (60, 400, 1)
    assert (m.verify_calls, m.drafted_tokens, m.accepted_tokens) == (1, 2, 1)
    assert m.verify_latencies_s == [0.02] and m.session_reopens == 1 and m.wall_s > 0
