"""Generation metrics, with vLLM's definitions so numbers compare across tools.

* acceptance rate = accepted draft tokens / proposed draft tokens;
* mean acceptance length = output tokens / verify calls;
* per-position acceptance[i] = drafts whose token i + 1 was accepted / drafts, where a *draft*
  is one verify call that proposed at least one token (vLLM's ``num_accepted_tokens_per_pos /
  num_drafts``). It is unconditional: a block that proposed fewer than i + 1 tokens counts as
  not accepted at i, so with a varying k (``auto``, a confidence stop, lookup misses) the curve
  also shows how often position i was drafted at all. Its sum + 1 is the mean acceptance length
  over drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class GenerationMetrics:
    new_tokens: int = 0
    wall_s: float = 0.0
    verify_calls: int = 0
    drafts: int = 0  # verify calls that proposed at least one token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position i: times accepted
    bytes_sent: int = 0
    bytes_received: int = 0
    prefill_s: float = 0.0
    drafting_s: float = 0.0
    verify_rtt_s: float = 0.0
    verify_forward_s: float = 0.0  # time on the verifier (queue + forward), inside the trip
    verify_latencies_s: list[float] = field(default_factory=list)  # one per verify round trip
    retries: int = 0  # HTTP calls repeated after a connection error, 429 or 502-504
    session_reopens: int = 0  # sessions reopened after the verifier lost one
    draft_lengths: dict[int, int] = field(default_factory=dict)  # k of each drafted call: count

    def record_block(self, proposed: int, accepted: int) -> None:
        self.verify_calls += 1
        if proposed:
            self.draft_lengths[proposed] = self.draft_lengths.get(proposed, 0) + 1
        self.drafts += int(proposed > 0)
        self.drafted_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_at) < proposed:
            self.accepted_at.append(0)
        for i in range(accepted):
            self.accepted_at[i] += 1

    def per_position_acceptance(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_at] if self.drafts else []

    def to_dict(self) -> dict[str, Any]:
        calls = max(self.verify_calls, 1)
        client_s = self.wall_s - self.prefill_s - self.drafting_s - self.verify_rtt_s
        return {
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.new_tokens / self.wall_s, 3) if self.wall_s else 0.0,
            "verify_calls": self.verify_calls,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.drafted_tokens, 4)
            if self.drafted_tokens else 0.0,
            "mean_tokens_per_call": round(self.new_tokens / calls, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "draft_lengths": {str(k): n for k, n in sorted(self.draft_lengths.items())},
            # An autoregressive target spends one forward per new token; speculation one per call.
            "target_forwards_saved": self.new_tokens - self.verify_calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_per_token": round((self.bytes_sent + self.bytes_received)
                                     / max(self.new_tokens, 1), 1),
            "retries": self.retries,
            "session_reopens": self.session_reopens,
            "verify_latency_ms": {
                "p50": round(1e3 * quantile(self.verify_latencies_s, 0.5), 2),
                "p95": round(1e3 * quantile(self.verify_latencies_s, 0.95), 2),
            },
            "time_s": {
                "prefill_rtt": round(self.prefill_s, 4),
                "drafting": round(self.drafting_s, 4),
                "verify_rtt": round(self.verify_rtt_s, 4),
                "verify_forward": round(self.verify_forward_s, 4),
                "client": round(client_s, 4),
            },
        }


class TransportCounters(Protocol):
    bytes_sent: int
    bytes_received: int
    retries: int


class MetricsRecorder:
    """Fills one generation's :class:`GenerationMetrics`: wall time from its creation, and the
    transport's byte and retry counters as differences (the transport is shared by calls)."""

    def __init__(self, transport: TransportCounters) -> None:
        self.transport = transport
        self.metrics = GenerationMetrics()
        self.started = time.perf_counter()
        self._before = (transport.bytes_sent, transport.bytes_received, transport.retries)

    def prefilled(self) -> None:
        self.metrics.prefill_s = time.perf_counter() - self.started

    def block(self, draft_ids: list[int], num_accepted: int, drafting_s: float,
              round_trip_s: float, verifier_s: float) -> None:
        m = self.metrics
        m.record_block(len(draft_ids), num_accepted)
        m.drafting_s += drafting_s
        m.verify_rtt_s += round_trip_s
        m.verify_latencies_s.append(round_trip_s)
        m.verify_forward_s += verifier_s

    def finish(self, new_tokens: int, session_reopens: int = 0) -> GenerationMetrics:
        m, t = self.metrics, self.transport
        m.new_tokens, m.session_reopens = new_tokens, session_reopens
        m.wall_s = time.perf_counter() - self.started
        m.bytes_sent = t.bytes_sent - self._before[0]
        m.bytes_received = t.bytes_received - self._before[1]
        m.retries = t.retries - self._before[2]
        return m


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
