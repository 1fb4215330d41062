"""Generation metrics, with vLLM's definitions so numbers compare across tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationMetrics:
    new_tokens: int = 0
    wall_s: float = 0.0
    verify_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per draft position i: times proposed
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

    def record_block(self, proposed: int, accepted: int) -> None:
        self.verify_calls += 1
        self.drafted_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.proposed_at) < proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < accepted)

    def to_dict(self) -> dict[str, Any]:
        calls = max(self.verify_calls, 1)
        client_s = self.wall_s - self.prefill_s - self.drafting_s - self.verify_rtt_s
        return {
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.new_tokens / self.wall_s, 3) if self.wall_s else 0.0,
            "verify_calls": self.verify_calls,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.drafted_tokens, 4)
            if self.drafted_tokens else 0.0,
            "mean_tokens_per_call": round(self.new_tokens / calls, 4),
            "per_position_acceptance": [round(a / p, 4) if p else 0.0
                                        for a, p in zip(self.accepted_at, self.proposed_at,
                                                        strict=True)],
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


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
