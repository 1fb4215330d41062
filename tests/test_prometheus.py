"""The verifier's Prometheus endpoint: its counters agree with what the clients saw and with the
JSON metrics, error answers are counted by code, and it is key-protected when keys are on."""

from __future__ import annotations

from pathlib import Path

import httpx

from drafter_client.api import SpecDecClient
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.prometheus import scrape


def test_counters_match_the_clients_and_the_json(tiny_models: dict[str, Path]) -> None:
    with LiveServer(fp32_settings(tiny_models["gpt2-target"], max_draft_tokens=8)) as server:
        client = SpecDecClient(server.url, str(tiny_models["gpt2-drafter"]))
        results = [client.generate(p, num_draft_tokens=4, max_new_tokens=24)
                   for p in ("the cat sat", "def f ( x )")]
        sampled = client.generate("a big", num_draft_tokens=3, max_new_tokens=16,
                                  temperature=0.8, seed=1)
        bad = httpx.post(server.url + "/v1/sessions/nope/verify",
                         json={"position": 1, "last_token": 0, "final_uniform": 0.5})
        assert bad.status_code == 404
        values = scrape(server.url)
        json_metrics = httpx.get(server.url + "/v1/metrics").json()

    calls = sum(r.metrics.verify_calls for r in [*results, sampled])
    drafted = sum(r.metrics.drafted_tokens for r in [*results, sampled])
    accepted = sum(r.metrics.accepted_tokens for r in [*results, sampled])
    assert values["specdec_verifier_verify_calls_total"][()] == calls
    assert values["specdec_verifier_drafted_tokens_total"][()] == drafted
    assert values["specdec_verifier_accepted_tokens_total"][()] == accepted
    assert values["specdec_verifier_scored_tokens_total"][()] == drafted + calls
    assert values["specdec_verifier_acceptance_rate"][()] == round(accepted / drafted, 4)
    verify = (("method", "POST"), ("route", "/v1/sessions/{session_id}/verify"),
              ("status", "200"))
    assert values["specdec_verifier_requests_total"][verify] == calls
    assert values["specdec_verifier_requests_total"][
        (("method", "POST"), ("route", "/v1/sessions"), ("status", "200"))] == 3
    assert values["specdec_verifier_errors_total"][
        (("code", "session_not_found"), ("status", "404"))] == 1
    # every job of every batch is in the latency and batch histograms, the failed one too
    jobs = values["specdec_verifier_job_seconds_count"]
    assert jobs[(("kind", "verify"),)] == calls + 1
    assert jobs[(("kind", "create"),)] == 3
    assert values["specdec_verifier_batch_size_sum"][()] == calls + 1 + 3
    assert values["specdec_verifier_batch_size_count"][()] == json_metrics["batches"]
    # the state gauges are the JSON's numbers
    assert values["specdec_verifier_sessions_open"][()] == json_metrics["sessions"] == 0
    assert values["specdec_verifier_kv_slots_free"][()] == json_metrics["kv_slots_free"]
    assert (values["specdec_verifier_kv_slots_used"][()]
            + values["specdec_verifier_kv_slots_free"][()]
            == values["specdec_verifier_kv_slots"][()])


def test_sessions_open_and_key_protection(tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["gpt2-target"], api_keys="k-metrics")
    with LiveServer(settings) as server:
        assert httpx.get(server.url + "/metrics").status_code == 401
        opened = httpx.post(server.url + "/v1/sessions", json={"prompt_ids": [2, 3, 4]},
                            headers={"authorization": "Bearer k-metrics"})
        assert opened.status_code == 200
        values = scrape(server.url, "k-metrics")
        assert values["specdec_verifier_sessions_open"][()] == 1
        assert values["specdec_verifier_kv_slots_used"][()] == 1
        assert values["specdec_verifier_prefill_tokens_total"][()] == 2
        assert values["specdec_verifier_errors_total"][
            (("code", "unauthorized"), ("status", "401"))] == 1
