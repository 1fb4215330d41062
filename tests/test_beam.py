"""Beam search on the verifier (`/v1/generate` with num_beams, `specdec baseline --num-beams`)
equals transformers' `generate(num_beams=N, do_sample=False, ...)` token for token."""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_client.api import SpecDecClient
from drafter_client.apps.cli import run
from tests.support.live_server import LiveServer, fp32_settings
from verifier_service.scheduling.beam import BeamSearch

PROMPTS = [[2, 3, 4], [5, 9, 2, 7, 11]]


def hf_beam(model: Any, prompt: list[int], **kwargs: Any) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=1, **kwargs)
    return out[0, len(prompt):].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["gpt2-target", "llama-target", "peaky-target"])
def test_beam_search_equals_transformers(tiny_models: dict[str, Path], name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32).eval()
    cases = list(itertools.product(PROMPTS, [2, 4], [1.0, 0.5, -1.0], [False, True, "never"],
                                   [0, 2]))
    ended_at_eos = 0
    with LiveServer(fp32_settings(tiny_models[name])) as server:
        client = SpecDecClient(server.url, None, str(tiny_models[name]))
        for prompt, beams, penalty, early, ngram in cases:
            ours = client.baseline(prompt, max_new_tokens=12, num_beams=beams,
                                   length_penalty=penalty, early_stopping=early,
                                   no_repeat_ngram_size=ngram).token_ids
            reference = hf_beam(model, prompt, num_beams=beams, max_new_tokens=12,
                                length_penalty=penalty, early_stopping=early,
                                no_repeat_ngram_size=ngram or None)
            assert ours == reference, (prompt, beams, penalty, early, ngram)
            ended_at_eos += int(len(reference) < 12)
    if name == "peaky-target":
        assert ended_at_eos > 0  # the EOS paths were exercised


def test_beam_search_differs_from_greedy_and_bans_repeats(tiny_models: dict[str, Path]) -> None:
    """Not vacuous: on these prompts beam search finds other outputs than greedy, and
    no_repeat_ngram_size changes them."""
    with LiveServer(fp32_settings(tiny_models["gpt2-target"])) as server:
        client = SpecDecClient(server.url, None, str(tiny_models["gpt2-target"]))
        differs = banned = 0
        for prompt in [[2, 3, 4], [5, 9, 2, 7, 11], [12, 13], [6, 6, 6, 20]]:
            greedy = client.baseline(prompt, max_new_tokens=16).token_ids
            beam = client.baseline(prompt, max_new_tokens=16, num_beams=4).token_ids
            no_repeat = client.baseline(prompt, max_new_tokens=16, num_beams=4,
                                        no_repeat_ngram_size=1).token_ids
            differs += int(beam != greedy)
            banned += int(no_repeat != beam)
            assert len(set(no_repeat)) == len(no_repeat)  # no token twice (1-grams)
        assert differs > 0 and banned > 0


def test_beam_search_batches_with_other_clients(tiny_models: dict[str, Path]) -> None:
    """A beam search and speculative clients at the same time: each gets its own answer."""
    target, drafter = tiny_models["llama-target"], tiny_models["llama-drafter"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reference = hf_beam(model, PROMPTS[1], num_beams=3, max_new_tokens=20)
    with LiveServer(fp32_settings(target)) as server:
        # loaded one after another (loading a model sets torch's default dtype for a while)
        solo = SpecDecClient(server.url, str(drafter), dtype="float32")
        expected = solo.generate(PROMPTS[0], max_new_tokens=24).token_ids
        clients = [solo.fork() for _ in range(3)]
        results: dict[str, list[int]] = {}

        def speculative(i: int) -> None:
            results[f"spec{i}"] = clients[i].generate(PROMPTS[0], max_new_tokens=24).token_ids

        def beam() -> None:
            client = SpecDecClient(server.url, None, str(target))
            results["beam"] = client.baseline(PROMPTS[1], max_new_tokens=20,
                                              num_beams=3).token_ids

        threads = [threading.Thread(target=beam)] + [
            threading.Thread(target=speculative, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results.pop("beam") == reference
        assert all(tokens == expected for tokens in results.values()) and len(results) == 3
        stats = httpx.get(server.url + "/v1/metrics").json()
        assert stats["kv_slots_free"] == stats["kv_slots"]  # every beam slot went back


@pytest.mark.parametrize(("body", "field"), [
    ({"num_beams": 2, "sampling": {"temperature": 0.7}}, "num_beams"),
    ({"num_beams": 0}, "num_beams"),
    ({"num_beams": 65}, "num_beams"),
    ({"num_beams": 1, "no_repeat_ngram_size": 2}, "num_beams"),
    ({"num_beams": 2, "stop_at_eos": False}, "stop_at_eos"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"num_beams": 2, "length_penalty": float("nan")}, "length_penalty"),
])
def test_bad_beam_requests_are_4xx(llama_server: LiveServer, body: dict[str, Any],
                                   field: str) -> None:
    payload = orjson.dumps({"prompt_ids": [2, 3], "max_new_tokens": 4, **body},
                           option=orjson.OPT_SERIALIZE_NUMPY)
    if "nan" in str(body):
        payload = payload.replace(b"null", b"NaN")
    response = httpx.post(llama_server.url + "/v1/generate", content=payload,
                          headers={"content-type": "application/json"})
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert field in (error["field"] or "") or field in error["message"], error
    assert httpx.post(llama_server.url + "/v1/generate", json={
        "prompt_ids": [2, 3], "max_new_tokens": 4, "num_beams": 2}).status_code == 200


def test_cli_num_beams(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2-target"],
                                                 dtype=torch.float32).eval()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(["baseline", "--verifier-url", gpt2_server.url, "--tokenizer",
                    str(tiny_models["gpt2-target"]), "--prompt", "the cat sat", "--json",
                    "--max-new-tokens", "10", "--num-beams", "3", "--early-stopping", "never",
                    "--length-penalty", "0.5"])
    assert code == 0
    body = orjson.loads(out.getvalue())
    assert body["token_ids"] == hf_beam(model, body["prompt_token_ids"], num_beams=3,
                                        max_new_tokens=10, early_stopping="never",
                                        length_penalty=0.5)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(["baseline", "--verifier-url", gpt2_server.url, "--prompt", "x",
                    "--num-beams", "2", "--temperature", "0.5"])
    assert code == 2 and "--num-beams" in err.getvalue()


def test_beam_state_alone() -> None:
    """The search on hand-made logits: a sure EOS on one beam finishes a hypothesis."""
    search = BeamSearch([0], num_beams=2, max_length=4, eos_ids=[1])
    first = torch.full((2, 4), -10.0)
    first[:, 2], first[:, 3] = 0.0, -0.5  # tokens 2 and 3 lead
    parents, tokens, done = search.step(first)
    assert sorted(tokens) == [2, 3] and parents == [0, 0] and not done
    second = torch.full((2, 4), -10.0)
    second[:, 1] = 0.0  # EOS everywhere
    second[:, 2] = -3.0
    parents, tokens, done = search.step(second)
    assert search.is_finished.any()
    assert search.result()[-1] == 1


BEAM_KEYS = ("beam-key-a-0123", "beam-key-b-4567")


def test_every_beam_counts_against_the_key_quota_and_no_other_key_loses_a_session(
        tiny_models: dict[str, Path]) -> None:
    """With 3 sessions per key and 4 KV slots: a search of N beams is N sessions to the key's
    quota (429 naming num_beams beyond it); it may take free slots and evict its own key's
    sessions, never another key's (503 with Retry-After instead)."""
    settings = fp32_settings(tiny_models["gpt2-target"], api_keys=",".join(BEAM_KEYS),
                             max_sessions_per_key=3, max_context=64, kv_budget_tokens=256)
    a, b = ({"authorization": f"Bearer {key}"} for key in BEAM_KEYS)
    beams = {"prompt_ids": [2, 3, 4], "max_new_tokens": 4}
    with LiveServer(settings) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/v1/metrics", headers=a).json()["kv_slots"] == 4
        assert http.post("/v1/generate", json={**beams, "num_beams": 4},
                         headers=a).status_code == 429  # 4 beams > 3 a key
        others = [http.post("/v1/sessions", json={"prompt_ids": [5, 6]}, headers=b)
                  .json()["session_id"] for _ in range(2)]
        mine = http.post("/v1/sessions", json={"prompt_ids": [5, 6]}, headers=a).json()
        over = http.post("/v1/generate", json={**beams, "num_beams": 3}, headers=a)
        assert over.status_code == 429 and over.json()["error"]["field"] == "num_beams"
        # 2 beams: the free slot and the key's own session's, which is evicted
        assert http.post("/v1/generate", json={**beams, "num_beams": 2},
                         headers=a).status_code == 200
        assert http.post(f"/v1/sessions/{mine['session_id']}/verify", headers=a, json={
            "position": 2, "last_token": 6, "final_uniform": 0.5}).status_code == 404
        # 3 beams: 2 free slots, no session of its own; key b's two stay
        full = http.post("/v1/generate", json={**beams, "num_beams": 3}, headers=a)
        assert full.status_code == 503 and full.headers["retry-after"], full.text
        for sid in others:
            assert http.post(f"/v1/sessions/{sid}/verify", headers=b, json={
                "position": 2, "last_token": 6, "final_uniform": 0.5}).status_code == 200
        stats = http.get("/v1/metrics", headers=a).json()
        assert stats["kv_slots_free"] == 2 and stats["sessions"] == 2
