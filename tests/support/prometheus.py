"""Reading a server's Prometheus endpoint in tests: {metric name: {sorted label pairs: value}}."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import wait_until

Samples = dict[str, dict[tuple[Any, ...], float]]


def scrape(url: str, key: str | None = None) -> Samples:
    headers = {"authorization": f"Bearer {key}"} if key else None
    response = httpx.get(url + "/metrics", headers=headers)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    values: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = \
                sample.value
    return values


def wait_for_idle(gateway_url: str, verifier_url: str, within_s: float = 30.0) -> None:
    """Until the gateway runs no generation and the verifier holds no session (a generation
    whose client left has stopped and closed its session); TimeoutError after ``within_s``."""
    def idle() -> bool:
        running = scrape(gateway_url)["specdec_gateway_requests_running"][()]
        return running == 0 and httpx.get(verifier_url + "/v1/metrics").json()["sessions"] == 0

    wait_until(idle, timeout_s=within_s, interval_s=0.05,
               what="no generation on the gateway and no session on the verifier")
