"""Prometheus metrics of the verifier (``GET /metrics``, text exposition format).

Two sources, one registry per app (tests run several apps in one process):

* events, observed when they happen: HTTP requests by route and status (with the error code of
  every 4xx / 5xx), request latency, per-job queue wait and time in the verifier, batch sizes and
  forward times - :class:`Telemetry`, fed by :class:`shared.http.metrics.RequestMetrics` and by
  the scheduler;
* state, read when Prometheus scrapes: sessions, KV slots, evictions, replays, tokens scored and
  accepted - :class:`StateCollector` over the running
  :class:`~verifier_service.state.VerifierState`.

Metric names follow Prometheus' conventions (``_total`` counters, ``_seconds`` units); the
reference is docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from shared.http.metrics import LATENCY_BUCKETS, HttpMetrics

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

__all__ = ["CONTENT_TYPE_LATEST", "StateCollector", "Telemetry"]


class Telemetry:
    """The verifier's event metrics, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._kinds: dict[str, tuple[Any, Any]] = {}
        r = self.registry
        self.http = HttpMetrics("specdec_verifier", r)
        self.job_seconds = Histogram("specdec_verifier_job_seconds", "Time a job spent in the "
                                     "verifier: queue wait + its batch's forward + acceptance",
                                     ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait_seconds = Histogram("specdec_verifier_queue_wait_seconds", "Time a job "
                                            "waited in the queue before its batch started",
                                            ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("specdec_verifier_batch_size", "Jobs per batched forward",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("specdec_verifier_batch_tokens", "Tokens per batched "
                                      "forward", buckets=TOKEN_BUCKETS, registry=r)
        self.forward_seconds = Histogram("specdec_verifier_forward_seconds", "Time of one batch "
                                         "on the model thread (forward + every job's answer)",
                                         buckets=LATENCY_BUCKETS, registry=r)

    def observe_batch(self, jobs: list[tuple[str, float]], tokens: int, started: float,
                      ended: float) -> None:
        """One batch: ``jobs`` as (kind, queued_at) pairs, perf_counter times."""
        self.batch_size.observe(len(jobs))
        self.batch_tokens.observe(tokens)
        self.forward_seconds.observe(ended - started)
        for kind, queued_at in jobs:
            waited, took = self._by_kind(kind)
            waited.observe(started - queued_at)
            took.observe(ended - queued_at)

    def _by_kind(self, kind: str) -> tuple[Any, Any]:
        """The labelled histograms of a job kind, looked up once (``labels()`` costs a lock and
        a dict lookup per call, and this runs for every job of every batch)."""
        pair = self._kinds.get(kind)
        if pair is None:
            pair = self._kinds[kind] = (self.queue_wait_seconds.labels(kind),
                                        self.job_seconds.labels(kind))
        return pair

    def add_state(self, read: Callable[[], dict[str, Any] | None]) -> None:
        self.registry.register(StateCollector(read))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class StateCollector:
    """Counters and gauges read from the running verifier at scrape time. ``read`` returns
    ``VerifierState.metrics()`` (None before the lifespan has built it)."""

    def __init__(self, read: Callable[[], dict[str, Any] | None]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []  # names are only known from a reading; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        m = self.read()
        if m is None:
            return
        gauges = {
            "sessions_open": ("Sessions holding a KV slot", m["sessions"]),
            "kv_slots": ("KV pool size in smallest regions (sessions at their shortest)",
                         m["kv_slots"]),
            "kv_slots_used": ("Smallest regions' worth of the KV pool in use",
                              m["kv_slots"] - m["kv_slots_free"]),
            "kv_slots_free": ("Sessions that could still open (smallest regions free)",
                              m["kv_slots_free"]),
            "kv_pool_bytes": ("Bytes of the KV pool", m["kv_pool_bytes"]),
            "queued_jobs": ("Jobs waiting for a batch", m["queued"]),
            "acceptance_rate": ("Accepted / drafted tokens since start (rate() the two counters "
                                "for a window)", m["acceptance_rate"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"specdec_verifier_{name}", doc, value=value)
        counters = {
            "verify_calls": ("Verify calls that ran a forward", m["verify_calls"]),
            "replayed_calls": ("Retried verify calls answered from the session's last reply",
                               m["replayed_calls"]),
            "scored_tokens": ("Tokens scored by verify calls (k + 1 per call)",
                              m["scored_tokens"]),
            "drafted_tokens": ("Draft tokens received in verify calls", m["drafted_tokens"]),
            "accepted_tokens": ("Draft tokens accepted", m["accepted_tokens"]),
            "prefill_tokens": ("Prompt tokens of new sessions (written with their first block)",
                               m["prefill_tokens"]),
            "sessions_evicted": ("Sessions evicted to make room", m["evicted_sessions"]),
            "sessions_expired": ("Sessions dropped after their idle TTL", m["expired_sessions"]),
            "queue_full_rejections": ("Calls answered 429 because the job queue was full",
                                      m["rejected_queue_full"]),
            "non_finite_calls": ("Calls failed with 500 because the engine's rows held NaN "
                                 "or infinite values", m["non_finite_calls"]),
            "kv_region_moves": ("Sessions that outgrew their KV region and were copied to a "
                                "larger one", m["kv_region_moves"]),
            "static_forwards": ("Forwards run in a static-shape bucket (--cuda-graphs)",
                                m["static_forwards"]),
            "static_fallbacks": ("Forwards that fit no bucket and ran eagerly (--cuda-graphs)",
                                 m["static_fallbacks"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"specdec_verifier_{name}", doc, value=value)
        yield from router_metrics(m)


def router_metrics(m: dict[str, Any]) -> Iterator[Metric]:
    """The same state under vLLM's names and meanings, which inference routers read (llm-d,
    the Gateway API Inference Extension): the load gauges and the speculation counters, with
    vLLM's ``model_name`` and ``engine`` labels. docs/metrics.md maps each to ours."""
    labels, values = ["model_name", "engine"], [m["model"], "0"]

    def family(kind: type, name: str, doc: str, value: float) -> Metric:
        metric = kind(f"vllm:{name}", doc, labels=labels)
        metric.add_metric(values, value)
        return metric

    slots = m["kv_slots"]
    yield family(GaugeMetricFamily, "num_requests_running", "Sessions open (each holds its KV "
                 "cache, as a running request does)", m["sessions"])
    yield family(GaugeMetricFamily, "num_requests_waiting", "Jobs waiting for a batch",
                 m["queued"])
    yield family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage; 1 means 100 "
                 "percent", (slots - m["kv_slots_free"]) / slots if slots else 0.0)
    yield family(CounterMetricFamily, "spec_decode_num_drafts", "Verify calls with at least one "
                 "draft", m["drafts"])
    yield family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens received",
                 m["drafted_tokens"])
    yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens "
                 "accepted", m["accepted_tokens"])
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at this 0-based "
        "position was accepted", labels=[*labels, "position"])
    for position, count in enumerate(m["accepted_at"]):
        per_position.add_metric([*values, str(position)], count)
    yield per_position
