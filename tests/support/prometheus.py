"""Reading a server's Prometheus endpoint in tests: {metric name: {sorted label pairs: value}}."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

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
