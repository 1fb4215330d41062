"""The verifier's Prometheus endpoint: its counters agree with what the clients saw and with the
JSON metrics, error answers are counted by code, and it is key-protected when keys are on."""

from __future__ import annotations

from pathlib import Path

import httpx

from drafter_client.api import SpecDecClient
from drafter_client.transport import HttpVerifier
from shared.protocol.schema import AFFINITY_HEADER
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
    # the same under vLLM's names, as routers read them (llm-d, Gateway API Inference Extension)
    runs = [*results, sampled]
    model = (("engine", "0"), ("model_name", json_metrics["model"]))
    assert values["vllm:spec_decode_num_drafts_total"][model] \
        == sum(r.metrics.drafts for r in runs) > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"][model] == drafted
    assert values["vllm:spec_decode_num_accepted_tokens_total"][model] == accepted
    per_position = values["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    width = max(len(r.metrics.accepted_at) for r in runs)
    assert sorted(per_position) == [(*model, ("position", str(i))) for i in range(width)]
    for i in range(width):
        assert per_position[(*model, ("position", str(i)))] == sum(
            r.metrics.accepted_at[i] for r in runs if i < len(r.metrics.accepted_at))
    assert sum(per_position.values()) == accepted
    assert values["vllm:num_requests_running"][model] == 0
    assert values["vllm:num_requests_waiting"][model] == 0
    assert values["vllm:kv_cache_usage_perc"][model] == 0.0
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
        [running] = values["vllm:num_requests_running"].values()
        [usage] = values["vllm:kv_cache_usage_perc"].values()
        assert running == 1
        assert usage == 1 / values["specdec_verifier_kv_slots"][()]
        assert values["specdec_verifier_prefill_tokens_total"][()] == 2
        assert values["specdec_verifier_errors_total"][
            (("code", "unauthorized"), ("status", "401"))] == 1


class Router(httpx.HTTPTransport):
    """An inference router's session affinity as llm-d does it: every answer carries
    ``x-session-token`` naming the replica (``token``; None: a router without affinity); what
    the client sent with each session call is kept."""

    def __init__(self, token: str | None) -> None:
        super().__init__()
        self.token = token
        self.sent: list[tuple[str, str | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/sessions"):
            self.sent.append((request.url.path, request.headers.get(AFFINITY_HEADER)))
        response = super().handle_request(request)
        if self.token is not None:
            response.headers[AFFINITY_HEADER] = self.token
        return response


def test_the_client_echoes_the_routers_session_token(tiny_models: dict[str, Path]) -> None:
    """Each session call after the first carries the token the router set; the control, a
    router that sets none, gets none back."""
    with LiveServer(fp32_settings(tiny_models["gpt2-target"], max_draft_tokens=8)) as server:
        for token in ("replica-a", None):
            router = Router(token)
            verifier = HttpVerifier(server.url, client=httpx.Client(base_url=server.url,
                                                                    transport=router))
            client = SpecDecClient(verifier, str(tiny_models["gpt2-drafter"]))
            client.generate("the cat sat", num_draft_tokens=4, max_new_tokens=12)
            first, *later = router.sent
            assert first == ("/v1/sessions", None)  # a new session: the router places it
            assert len(later) >= 2 and all(sent == token for _, sent in later), later
            assert verifier.affinity == {}  # the session was closed: its token is gone
