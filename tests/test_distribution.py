"""The output distribution of speculative sampling is exactly the target's.

For a vocabulary of 16, the exact probability of every pair of first two generated tokens (of
the first three, where drafts made ahead must be reached) is enumerated from the target
(processed with transformers' own logits warpers, an independent implementation), then
compared with 5,000 seeded speculative generations (3,000 for the variants: trees, hybrid,
drafting ahead, concurrent clients) by a chi-square test (cells with expected
count < 5 pooled). Correct sampling must pass at p > 1e-3 and total
variation < 0.1 after all its draws; the negative controls (a wrong acceptance rule, a fresh
resample instead of the residual) must fail the same test at p < 1e-6 within 2,000 draws (they
stop at the first check, every 250 draws, that is already below it).

The draws run the client's whole loop against the verifier's own jobs in this process
(``tests/support/in_process.py``: the same validation, KV slot pool, sampling and JSON wire
codec, without sockets), which makes them about twice as fast; the concurrent-clients test
draws through a real uvicorn verifier over HTTP with batching on.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

import drafter_client.speculative as speculative
import shared.protocol.acceptance as acceptance
import shared.protocol.sampling as sampling
from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from shared.models.catalog import load_causal_lm
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.statistics import (
    MODEL_FREE_WORKERS,
    PROMPT,
    accept_everything,
    chi_square_p,
    exact_pair_distribution,
    exact_token_distribution,
    sample_pairs,
)
from verifier_service.settings import Settings

pytestmark = pytest.mark.slow

RUNS = 5000
CONTROL_RUNS = 2000  # fewer draws make a wrong rule harder to catch, so this is conservative
# Trees, hybrid drafting, drafting ahead and concurrent clients run the same acceptance code
# as the first-two-token tests (which keep RUNS) along other paths: 3,000 draws, still 1.5x
# what their negative control (the naive tree rule) needs to fail at p < 1e-6 - it fails
# within its first 500 here - for a suite that fits its 8 minutes on a 2-core machine.
VARIANT_RUNS = 3000
CONFIGS = {
    "T=1": {"temperature": 1.0},
    "T=0.7,top-k=5": {"temperature": 0.7, "top_k": 5},
    "T=1,top-p=0.8": {"temperature": 1.0, "top_p": 0.8},
}


@pytest.fixture(scope="module")
def verifier(tiny_models: dict[str, Path]) -> InProcessVerifier:
    return InProcessVerifier.load(fp32_settings(tiny_models["peaky-target"],
                                                max_draft_tokens=8))


@pytest.fixture(scope="module")
def client(verifier: InProcessVerifier, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(verifier, str(tiny_models["peaky-drafter"]), dtype="float32",
                         device="cpu")


@pytest.fixture(scope="module")
def llama_client(verifier: InProcessVerifier, tiny_models: dict[str, Path],
                 peaky_gguf: Path) -> SpecDecClient:
    """The client's defaults with the drafter on llama.cpp (the peaky drafter as a GGUF)."""
    return tree_client(verifier, DrafterOptions(), tiny_models, "llama-cpp", peaky_gguf)


# Which engine runs the model drafter (see the trees below for why either shows the same).
FIRST_TWO_ENGINE = {"T=1": "transformers", "T=0.7,top-k=5": "llama-cpp",
                    "T=1,top-p=0.8": "llama-cpp"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_two_tokens_follow_the_target(name: str, request: pytest.FixtureRequest,
                                            tiny_models: dict[str, Path]) -> None:
    params = CONFIGS[name]
    client: SpecDecClient = request.getfixturevalue(
        "client" if FIRST_TWO_ENGINE[name] == "transformers" else "llama_client")
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, RUNS), exact)
    assert p_value > 1e-3, f"{name}: chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"{name}: TV = {tv:.3f}"


def test_negative_control_accept_everything(client: SpecDecClient,
                                            tiny_models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A deliberately wrong acceptance rule (accept every draft) must fail the same test."""
    accept_everything(monkeypatch)
    params = CONFIGS["T=1"]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, CONTROL_RUNS, exact=exact), exact)
    assert p_value < 1e-6, f"wrong rule not caught: p = {p_value:.2e}, TV = {tv:.3f}"


def test_negative_control_fresh_resample(client: SpecDecClient, tiny_models: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing the recovered token fresh from p (not from max(0, p - q)) must be caught."""
    def fresh(target_row, draft_row, uniform):  # type: ignore[no-untyped-def]
        return sampling.sample_from_probs(target_row, uniform)

    monkeypatch.setattr(speculative, "recover_token", fresh)
    params = CONFIGS["T=1"]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, CONTROL_RUNS, exact=exact), exact)
    assert p_value < 1e-6, f"fresh resample not caught: p = {p_value:.2e}, TV = {tv:.3f}"


# Model-free drafters: deterministic (one-hot) drafts. The verifier draws the recovered token from
# p without the draft token. The prompt [2, 3, t, 5, 3] makes every drafter propose t first (it
# followed 3 before); t is chosen so that p(t) is near 1/2, where a wrong recovery rule shows most
# (the fresh-resample bug moves P(t) from p to p(2 - p)).
MODEL_FREE = {
    "ngram-simple": ("ngram", DrafterOptions(ngram_kind="simple", ngram_n=2)),
    "ngram-multi+filler": ("ngram", DrafterOptions(ngram_n=4, ngram_top_k_filler=2)),
    "prompt-lookup": ("prompt-lookup", DrafterOptions()),
    "bigram": ("bigram", DrafterOptions()),
}


@pytest.fixture(scope="module")
def repeat_prompt(tiny_models: dict[str, Path]) -> list[int]:
    model = load_causal_lm(str(tiny_models["peaky-target"]), torch.float32, torch.device("cpu"))
    candidates = list(range(2, 16))
    with torch.no_grad():
        logits = model(torch.tensor([[2, 3, t, 5, 3] for t in candidates])).logits[:, -1]
    probs = torch.softmax(logits.double(), dim=-1)  # [candidates, V] at T=1
    p_t = probs[torch.arange(len(candidates)), torch.tensor(candidates)]
    best = int(torch.argmax(p_t * (1 - p_t)))
    assert 0.15 < float(p_t[best]) < 0.85, "no useful draft token for this tiny model"
    return [2, 3, candidates[best], 5, 3]


def model_free_client(verifier: InProcessVerifier, name: str,
                      tiny_models: dict[str, Path]) -> SpecDecClient:
    drafter, options = MODEL_FREE[name]
    return SpecDecClient(verifier, drafter, tokenizer=str(tiny_models["peaky-target"]),
                         options=options)


@pytest.mark.parametrize("name", list(MODEL_FREE))
def test_model_free_drafters_follow_the_target(name: str, verifier: InProcessVerifier,
                                               tiny_models: dict[str, Path],
                                               repeat_prompt: list[int]) -> None:
    client = model_free_client(verifier, name, tiny_models)
    params = CONFIGS["T=1"] if name != "ngram-multi+filler" else CONFIGS["T=0.7,top-k=5"]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids, repeat_prompt)
    counts = sample_pairs(client, params, RUNS, repeat_prompt, k=2, workers=MODEL_FREE_WORKERS)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, f"{name}: chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"{name}: TV = {tv:.3f}"


@pytest.mark.parametrize("path", ["device", "host"])
def test_negative_control_fresh_resample_for_one_hot_drafts(
        verifier: InProcessVerifier, tiny_models: dict[str, Path], repeat_prompt: list[int],
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The known NASD bug: after a rejected one-hot draft d, drawing a fresh token from p outputs
    d with probability p(d)(2 - p(d)) instead of p(d). The same test must catch it, in the
    verifier's batched device acceptance and in its host path."""
    monkeypatch.setattr(verifier.engine, "acceptance", path)
    if path == "host":
        monkeypatch.setattr(acceptance, "residual_without_token", lambda probs, token: probs)
    else:
        monkeypatch.setattr(acceptance, "remove_rejected", lambda weights, tokens: weights)
    client = model_free_client(verifier, "ngram-simple", tiny_models)
    params = CONFIGS["T=1"]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids, repeat_prompt)
    counts = sample_pairs(client, params, CONTROL_RUNS, repeat_prompt, k=2, exact=exact,
                          workers=MODEL_FREE_WORKERS)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, f"fresh resample not caught: p = {p_value:.2e}, TV = {tv:.3f}"


@pytest.fixture(scope="module")
def peaky_gguf(tiny_models: dict[str, Path]) -> Path:
    from tests.support.tiny_gguf import save_tiny_gguf

    return save_tiny_gguf(tiny_models["peaky-drafter"])


@pytest.fixture(scope="module")
def server_settings(tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models["peaky-target"], max_draft_tokens=8)


def test_distribution_holds_with_concurrent_clients(server: LiveServer,
                                                    tiny_models: dict[str, Path],
                                                    peaky_gguf: Path) -> None:
    """Four clients at once over HTTP, their blocks batched into shared forwards: still
    exact. Seeds RUNS..RUNS + VARIANT_RUNS - 1, so these draws are independent of the
    in-process ones. The drafters run on llama.cpp (which lets go of the GIL while it
    decodes)."""
    params = CONFIGS["T=1"]
    clients = [SpecDecClient(server.url, str(peaky_gguf), tokenizer=str(
        tiny_models["peaky-target"]), options=DrafterOptions(engine="llama-cpp", threads=1))
        for _ in range(4)]
    before = httpx.get(f"{server.url}/v1/metrics").json()
    counts: Counter = Counter()

    def worker(index: int) -> None:
        mine = sample_pairs(clients[index], params, VARIANT_RUNS,
                            seeds=range(RUNS + index, RUNS + VARIANT_RUNS, len(clients)))
        counts.update(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = httpx.get(f"{server.url}/v1/metrics").json()
    assert sum(counts.values()) == VARIANT_RUNS
    assert after["jobs"] - before["jobs"] > after["batches"] - before["batches"]  # batched
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     clients[0].info.eos_token_ids)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, f"concurrent: chi-square p = {p_value:.2e}, TV = {tv:.3f}"


# Token trees (one-hot candidates, several per position) and hybrid drafting. The tree's
# children are tested one after another without replacement (shared/protocol/acceptance.py); the
# naive rule
# - every child tested against the untouched p - must fail the same test. Trees, the hybrid and
# drafting ahead are the model drafters' common code (``LMDrafter``): these draw with the
# drafter on llama.cpp (the same weights as a float32 GGUF; its forwards cost half of
# transformers' on a model this small); transformers' drafter draws in the tests above and in
# the naive-tree control. (Whatever q a drafter computes, exactness holds as long as it reports
# the q it drew from: what an engine does wrong shows in acceptance, not in the distribution.)
TREES = {
    "tree3,T=1": (DrafterOptions(lookup=False, tree_width=3, draft_min_prob=0.6), CONFIGS["T=1"],
                  "llama-cpp"),
    "tree3,T=0.7,top-k=5": (DrafterOptions(lookup=False, tree_width=3),
                            CONFIGS["T=0.7,top-k=5"], "llama-cpp"),
    "hybrid+tree,T=1,top-p=0.8": (DrafterOptions(tree_width=2, lookup=True),
                                  CONFIGS["T=1,top-p=0.8"], "llama-cpp"),
    "hybrid,T=1": (DrafterOptions(lookup=True), CONFIGS["T=1"], "llama-cpp"),
    "overlap,T=1": (DrafterOptions(lookup=False, overlap=True), CONFIGS["T=1"], "llama-cpp"),
    "overlap+tree3,T=0.7,top-k=5": (DrafterOptions(lookup=False, overlap=True, tree_width=3),
                                    CONFIGS["T=0.7,top-k=5"], "llama-cpp"),
}


def tree_client(verifier: InProcessVerifier, options: DrafterOptions,
                tiny_models: dict[str, Path], engine: str = "transformers",
                gguf: Path | None = None) -> SpecDecClient:
    if engine == "llama-cpp":
        assert gguf is not None
        return SpecDecClient(verifier, str(gguf), tokenizer=str(tiny_models["peaky-target"]),
                             options=dataclasses.replace(options, engine="llama-cpp",
                                                         threads=1))
    return SpecDecClient(verifier, str(tiny_models["peaky-drafter"]), dtype="float32",
                         device="cpu", options=options)


@pytest.mark.parametrize("name", list(TREES))
def test_trees_and_hybrid_follow_the_target(name: str, verifier: InProcessVerifier,
                                            tiny_models: dict[str, Path],
                                            repeat_prompt: list[int],
                                            monkeypatch: pytest.MonkeyPatch,
                                            peaky_gguf: Path) -> None:
    options, params, engine = TREES[name]
    client = tree_client(verifier, options, tiny_models, engine, peaky_gguf)
    prompt = repeat_prompt if options.lookup else PROMPT  # a lookup match for the hybrid
    if not options.overlap:
        exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                         client.info.eos_token_ids, prompt)
        counts = sample_pairs(client, params, VARIANT_RUNS, prompt, k=2)
    else:
        # A draft made ahead is for the block after a fully accepted one: with k = 1 the first
        # block outputs at most 2 tokens, so the first 3 tokens are where drafts made ahead are
        # verified (about one draw in three here); the first 2 would never see one.
        exact = exact_token_distribution(tiny_models["peaky-target"], params,
                                         client.info.eos_token_ids, prompt, n=3)
        used = []
        take = speculative.InFlight.take

        def counted_take(self, tokens):  # type: ignore[no-untyped-def]
            draft = take(self, tokens)
            used.extend([1] if draft is not None else [])
            return draft

        monkeypatch.setattr(speculative.InFlight, "take", counted_take)
        counts = sample_pairs(client, params, VARIANT_RUNS, prompt, k=1, n=3)
        assert len(used) > VARIANT_RUNS // 10, f"only {len(used)} blocks were drafted ahead"
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, f"{name}: chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"{name}: TV = {tv:.3f}"


def naive_accept_tree(parents, draft_ids, log_uniforms, node_logprobs=None,  # type: ignore[no-untyped-def]
                      target_argmax=None):
    """The wrong multi-draft rule: each child tested against the untouched p."""
    children = acceptance.tree_children(parents)
    path, here = [], -1
    while True:
        rejected = []
        chosen = next((c for c in children[here + 1]
                       if log_uniforms[c] < node_logprobs[c]), None)
        if chosen is None:
            rejected = [draft_ids[c] for c in children[here + 1]]
            return path, rejected
        path.append(chosen)
        here = chosen


def test_negative_control_naive_tree_rule(verifier: InProcessVerifier,
                                          tiny_models: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # one rule: the verifier and the client
    monkeypatch.setattr(acceptance, "accept_tree", naive_accept_tree)
    options, params, _ = TREES["tree3,T=1"]
    client = tree_client(verifier, options, tiny_models)
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, CONTROL_RUNS, k=2, exact=exact),
                               exact)
    assert p_value < 1e-6, f"naive tree rule not caught: p = {p_value:.2e}, TV = {tv:.3f}"


# Reproducible sampling: each position's token is the Gumbel-max choice under noise from
# (seed, position). Over seeds it must follow the target exactly; noise that ignores the
# position (the same noise at every step) keeps each token's marginal right but ties the two
# tokens together - the pair test must catch that.
@pytest.mark.parametrize("name", ["T=1", "T=1,top-p=0.8"])
def test_reproducible_sampling_follows_the_target(name: str, llama_client: SpecDecClient,
                                                  tiny_models: dict[str, Path]) -> None:
    client = llama_client  # drafts are the drafter's Gumbel-max choices: any engine's do
    params = CONFIGS[name]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    counts = sample_pairs(client, {**params, "reproducible": True}, RUNS)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, f"{name}: chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"{name}: TV = {tv:.3f}"


def test_negative_control_noise_shared_across_positions(llama_client: SpecDecClient,
                                                        tiny_models: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    client = llama_client  # the same drafter as the tests it controls
    real = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise",
                        lambda seed, position, vocab: real(seed, 0, vocab))
    params = CONFIGS["T=1"]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    # A subtler error than the others (TV about 0.09): it may take all RUNS draws.
    counts = sample_pairs(client, {**params, "reproducible": True}, RUNS, exact=exact)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, f"position-blind noise not caught: p = {p_value:.2e}, TV = {tv:.3f}"

