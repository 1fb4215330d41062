"""Greedy speculative output equals the target's own generate(do_sample=False), through a real
uvicorn verifier, in fp32, for several prompts and k in {1, 2, 4, 8}."""

from __future__ import annotations

import pytest

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from tests.support.tiny_models import hf_greedy

PROMPTS = ["the cat sat on", "def x ( y ) :", "a big red dog ran to the", "if x = 1"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_matches_target_generate(arch, k, tiny_models, gpt2_server, llama_server):  # type: ignore[no-untyped-def]
    server = gpt2_server if arch == "gpt2" else llama_server
    client = SpecDecClient(server.url, str(tiny_models[f"{arch}-drafter"]), dtype="float32",
                           device="cpu")
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = client.encode(prompt)
        result = client.generate(ids, num_draft_tokens=k, max_new_tokens=24)
        expected = hf_greedy(tiny_models[f"{arch}-target"], ids, 24)
        eos = client.info.eos_token_ids
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        assert result.token_ids == expected[:cut], f"prompt {prompt!r}, k={k}"
        m = result.metrics
        assert m.new_tokens == len(result.token_ids)
        assert m.new_tokens == m.verify_calls + m.accepted_tokens  # accepted + 1 per block
        accepted, drafted = accepted + m.accepted_tokens, drafted + m.drafted_tokens
    # Both branches ran: some drafts were accepted (bonus path) and some rejected (recovery).
    assert 0 < accepted < drafted


def test_baseline_matches_target_generate(tiny_models, gpt2_server):  # type: ignore[no-untyped-def]
    client = SpecDecClient(gpt2_server.url, None, tokenizer=str(tiny_models["gpt2-target"]))
    ids = client.encode("the cat sat on")
    result = client.baseline(ids, max_new_tokens=20)
    expected = hf_greedy(tiny_models["gpt2-target"], ids, 20)
    cut = next((i + 1 for i, t in enumerate(expected) if t in client.info.eos_token_ids),
               len(expected))
    assert result.token_ids == expected[:cut]


@pytest.mark.parametrize(("drafter", "options"), [
    ("ngram", DrafterOptions(ngram_kind="simple", ngram_n=3)),
    ("ngram", DrafterOptions(ngram_kind="multi", ngram_n=4, ngram_top_k_filler=3)),
    ("ngram", DrafterOptions(ngram_kind="multi", ngram_stop_if_unknown=True)),
    ("prompt-lookup", DrafterOptions()),
    ("bigram", DrafterOptions()),
])
@pytest.mark.parametrize("k", ["2", "auto", "heuristic"])
def test_greedy_model_free_drafters_match_target(drafter, options, k, tiny_models,  # type: ignore[no-untyped-def]
                                                 gpt2_server):
    client = SpecDecClient(gpt2_server.url, drafter, options=options)
    accepted = 0
    for prompt in ["the cat sat on the mat the cat sat on", "x + y = 1 x + y = 2 x + y"]:
        ids = client.encode(prompt)
        result = client.generate(ids, num_draft_tokens=k, max_new_tokens=30)
        expected = hf_greedy(tiny_models["gpt2-target"], ids, 30)
        cut = next((i + 1 for i, t in enumerate(expected) if t == 1), len(expected))
        assert result.token_ids == expected[:cut], f"{drafter} {options} k={k}"
        accepted += result.metrics.accepted_tokens
    if drafter != "bigram":
        assert accepted > 0  # the drafts were useful at least once
