"""Plain runs: a verify call with no drafts asks for more plain steps in the same round trip
(``more_uniforms`` -> ``more_tokens``), which ``-k 0`` and ``-k auto`` use where drafting does
not pay. The output is still the target's: greedy equals ``generate``, sampling follows the
target's distribution; the call is idempotent and refuses what it cannot do with a 422."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from drafter_client import SpecDecClient
from drafter_client.draft_length import PLAIN_RUN, CostModelLength
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.outcomes import observed
from tests.support.statistics import chi_square_p, exact_pair_distribution, sample_pairs
from tests.support.tiny_models import hf_greedy


def test_k0_greedy_in_plain_runs_equals_generate(tiny_models: dict[str, Path],
                                                 gpt2_server: LiveServer) -> None:
    client = SpecDecClient(gpt2_server.url, "ngram", tokenizer=str(tiny_models["gpt2-target"]))
    for prompt in ["the cat sat on", "def x ( y ) :"]:
        ids = client.encode(prompt)
        result = client.generate(ids, num_draft_tokens=0, max_new_tokens=30)
        expected = hf_greedy(tiny_models["gpt2-target"], ids, 30)
        cut = next((i + 1 for i, t in enumerate(expected) if t == 1), len(expected))
        assert result.token_ids == expected[:cut]
        # one call per 1 + PLAIN_RUN tokens, at most 1 + max_draft_tokens (8 here); the run is
        # cut by the tokens left
        run = 1 + min(PLAIN_RUN, client.info.max_draft_tokens)
        assert client.info.max_draft_tokens < PLAIN_RUN  # the verifier's cap is what binds
        assert result.metrics.verify_calls == -(-len(result.token_ids) // run)


def test_plain_run_is_idempotent_and_stops_at_the_context(llama_server: LiveServer) -> None:
    with httpx.Client(base_url=llama_server.url) as http:  # max_context 64
        sid = http.post("/v1/sessions", json={"prompt_ids": [2] * 60}).json()["session_id"]
        body = {"position": 60, "last_token": 2, "final_uniform": 0.5,
                "more_uniforms": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]}
        first = http.post(f"/v1/sessions/{sid}/verify", json=body)
        assert first.status_code == 200, first.text
        reply = first.json()
        # steps at positions 60..64: the last one writes the 64th cached token
        assert reply["position"] == 65 and len(reply["more_tokens"]) == 4
        again = http.post(f"/v1/sessions/{sid}/verify", json=body)
        assert again.json() == reply  # the same answer; the session moved once
        more = http.post(f"/v1/sessions/{sid}/verify", json={
            "position": 65, "last_token": reply["more_tokens"][-1], "final_uniform": 0.5})
        assert more.status_code == 422  # past the context: the run stopped where it had to
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204  # a shared server


@pytest.mark.parametrize(("extra", "field", "code"), [
    ({"draft_ids": [5], "log_uniforms": [-0.1]}, "more_uniforms", "plain_run_with_drafts"),
    ({"more_uniforms": [0.5] * 9}, "more_uniforms", "plain_run_too_long"),  # max 8 drafts
    ({"more_uniforms": [1.0]}, "more_uniforms.0", None),
])
def test_bad_plain_runs_are_refused(extra: dict, field: str, code: str | None,
                                    gpt2_server: LiveServer) -> None:
    with httpx.Client(base_url=gpt2_server.url) as http:
        sid = http.post("/v1/sessions", json={"prompt_ids": [2, 3]}).json()["session_id"]
        body = {"position": 2, "last_token": 3, "final_uniform": 0.5, "more_uniforms": [0.5],
                **extra}
        reply = http.post(f"/v1/sessions/{sid}/verify", json=body)
        assert reply.status_code == 422, reply.text
        error = reply.json()["error"]
        assert error["field"] == field and (code is None or error["code"] == code)
        fine = http.post(f"/v1/sessions/{sid}/verify", json={
            "position": 2, "last_token": 3, "final_uniform": 0.5, "more_uniforms": [0.5]})
        assert fine.status_code == 200 and fine.json()["position"] == 4  # nothing was lost
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204  # a shared server


def test_cost_model_asks_for_runs_where_drafting_cannot_pay() -> None:
    model = CostModelLength(verify_ms=[(0, 10.0), (1, 30.0), (2, 50.0)])
    model.update(observed(2, 1, 0.010, 0.050))  # the first block: its costs include the prefills
    model.update(observed(1, 0, 0.005, 0.030))  # 5 ms to draft a token, 30 ms to verify one
    assert model.next_k() == 0  # a 1-draft block costs 3 plain steps: drafting cannot pay
    assert model.plain_run(100) == PLAIN_RUN and model.plain_run(3) == 3
    model.update(observed(0, 0, 0.0, 0.090, plain_tokens=9))
    assert abs(model.rtt(0) - 0.010) < 1e-9  # a run's round trip counts per token


def test_plain_runs_shorten_where_copies_begin_and_calls_are_cheap() -> None:
    steep = [(k, 80.0 + 160.0 * k) for k in (0, 1, 2, 4, 8, 16)]  # drafting cannot pay: no probes
    model = CostModelLength(verify_ms=steep)
    # the first block: prefills, not counted
    model.update(observed(2, 1, 0.010, 0.500, forward_s=0.4))
    assert model.call_overhead() is None
    # 5 ms over the forwards
    model.update(observed(0, 0, 0.0, 0.725, plain_tokens=9, forward_s=0.72))
    assert model.call_overhead() == pytest.approx(0.005)
    assert model.plain_run(100) == PLAIN_RUN  # no copies tracked: the longest run
    assert model.plain_run(100, copy_rate=0.0) == PLAIN_RUN
    # one copy begun per 15 plain tokens: sqrt(0.005 / (0.067 * 0.08 * 0.3)) = 1.8 tokens
    assert model.plain_run(100, copy_rate=1 / 15) == 1
    assert model.plain_run(100, copy_rate=0.005) == 5  # rare copies: 6.5 -> a run of 6
    far = CostModelLength(verify_ms=steep)
    far.update(observed(2, 1, 0.010, 0.500, forward_s=0.4))
    far.update(observed(0, 0, 0.0, 0.820, plain_tokens=9, forward_s=0.72))  # 100 ms round trips
    assert far.plain_run(100, copy_rate=1 / 15) == 7  # sqrt(0.1 / 0.0017) = 7.6 tokens


@pytest.mark.slow
def test_sampled_plain_runs_follow_the_target(tiny_models: dict[str, Path]) -> None:
    verifier = InProcessVerifier.load(fp32_settings(tiny_models["peaky-target"],
                                                    max_draft_tokens=8))
    client = SpecDecClient(verifier, "bigram", tokenizer=str(tiny_models["peaky-target"]))
    params = {"temperature": 0.8, "top_p": 0.9}
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                    client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, 3000, k=0, workers=4), exact)
    assert p_value > 1e-3 and tv < 0.1, f"p = {p_value:.2e}, TV = {tv:.3f}"
