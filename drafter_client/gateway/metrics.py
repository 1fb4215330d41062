"""The gateway's Prometheus metrics: the client side of the split (tokens/s, acceptance,
per-position acceptance, round trips), next to the request counters of
:mod:`shared.http.metrics`. Reference: docs/metrics.md."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from drafter_client.metrics import GenerationMetrics
from drafter_client.speculative import GenerationResult
from shared.http.metrics import LATENCY_BUCKETS, HttpMetrics


class GatewayMetrics:
    """The gateway's Prometheus metrics (client side of the split)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.http = HttpMetrics("specdec_gateway", r)
        p = "specdec_gateway"
        self.running = Gauge(f"{p}_requests_running", "Generations running", registry=r)
        self.waiting = Gauge(f"{p}_requests_waiting", "Admitted generations waiting for a "
                             "worker", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens", registry=r)
        self.generated_tokens = Counter(f"{p}_generated_tokens", "Tokens generated",
                                        registry=r)
        self.verify_calls = Counter(f"{p}_verify_calls", "Verify round trips", registry=r)
        self.drafts = Counter(f"{p}_drafts", "Verify calls that proposed at least one token",
                              registry=r)
        self.drafted = Counter(f"{p}_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter(f"{p}_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_at = Counter(f"{p}_accepted_at_position", "Drafts whose token at this "
                                   "position (1-based) was accepted; / drafts = vLLM's "
                                   "per-position acceptance", ["position"], registry=r)
        self.retries = Counter(f"{p}_verifier_retries", "Verifier calls repeated after a "
                               "connection error, 429 or 502-504", registry=r)
        self.reopens = Counter(f"{p}_session_reopens", "Verifier sessions reopened after the "
                               "verifier lost one", registry=r)
        self.round_trip = Histogram(f"{p}_verify_round_trip_seconds", "One verify round trip",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram(f"{p}_time_to_first_token_seconds", "From admission to "
                                     "the first verified block", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.tokens_per_s = Histogram(f"{p}_tokens_per_second", "Generated tokens per second "
                                      "of one request", buckets=(1, 2, 5, 10, 20, 50, 100, 200,
                                                                 500, 1000, 2000),
                                      registry=r)

        # Lifetime ratios as gauges, for dashboards without PromQL (rate() the counters for
        # a window).
        self._totals = GenerationMetrics()
        self._lock = threading.Lock()
        r.register(_RatioCollector(self))

    def ratios(self) -> tuple[float, list[float]]:
        with self._lock:
            t = self._totals
            rate = t.accepted_tokens / t.drafted_tokens if t.drafted_tokens else 0.0
            return rate, t.per_position_acceptance()

    def finished(self, prompt_tokens: int, result: GenerationResult) -> None:
        m = result.metrics
        with self._lock:
            t = self._totals
            t.drafts += m.drafts
            t.drafted_tokens += m.drafted_tokens
            t.accepted_tokens += m.accepted_tokens
            t.accepted_at += [0] * (len(m.accepted_at) - len(t.accepted_at))
            for i, times in enumerate(m.accepted_at):
                t.accepted_at[i] += times
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(len(result.token_ids))
        self.verify_calls.inc(m.verify_calls)
        self.drafts.inc(m.drafts)
        self.drafted.inc(m.drafted_tokens)
        self.accepted.inc(m.accepted_tokens)
        for i, times in enumerate(m.accepted_at):
            self.accepted_at.labels(str(i + 1)).inc(times)
        self.retries.inc(m.retries)
        self.reopens.inc(m.session_reopens)
        for seconds in m.verify_latencies_s:
            self.round_trip.observe(seconds)
        if m.wall_s > 0 and result.token_ids:
            self.tokens_per_s.observe(len(result.token_ids) / m.wall_s)


class _RatioCollector:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rate, per_position = self.metrics.ratios()
        yield GaugeMetricFamily("specdec_gateway_acceptance_rate", "Accepted / drafted tokens "
                                "since start", value=rate)
        family = GaugeMetricFamily("specdec_gateway_per_position_acceptance", "vLLM's "
                                   "per-position acceptance since start: drafts whose token at "
                                   "this position was accepted / drafts", labels=["position"])
        for i, value in enumerate(per_position):
            family.add_metric([str(i + 1)], value)
        yield family
