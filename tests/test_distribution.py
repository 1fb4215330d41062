"""The output distribution of speculative sampling is exactly the target's.

For a vocabulary of 16, the exact probability of every pair of first two generated tokens is
enumerated from the target (processed with transformers' own logits warpers, an independent
implementation), then compared with 5,000 seeded speculative generations through the verifier app
by a chi-square test (cells with expected count < 5 pooled) through a real uvicorn verifier.
Correct sampling must pass at p > 1e-3 and total variation < 0.1; the negative controls (a wrong
acceptance rule, a fresh resample instead of the residual) must fail the same test at p < 1e-6
with 2,000 draws.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import drafter_client.speculative as speculative
import shared.sampling as sampling
from drafter_client import SpecDecClient
from shared.models import load_causal_lm
from tests.conftest import LiveServer, fp32_settings

pytestmark = pytest.mark.slow

RUNS = 5000
CONTROL_RUNS = 2000  # fewer draws make a wrong rule harder to catch, so this is conservative
PROMPT = [2, 3, 4]  # "the cat sat"
CONFIGS = {
    "T=1": {"temperature": 1.0},
    "T=0.7,top-k=5": {"temperature": 0.7, "top_k": 5},
    "T=1,top-p=0.8": {"temperature": 1.0, "top_p": 0.8},
}


@pytest.fixture(scope="module")
def client(tiny_models: dict[str, Path]) -> Iterator[SpecDecClient]:
    with LiveServer(fp32_settings(tiny_models["peaky-target"], max_draft_tokens=8)) as server:
        yield SpecDecClient(server.url, str(tiny_models["peaky-drafter"]), dtype="float32",
                            device="cpu")


def reference_probs(logits: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] probs with transformers' warpers (not our code)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params["temperature"])])
    if params.get("top_k"):
        warpers.append(TopKLogitsWarper(int(params["top_k"])))
    if params.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(params["top_p"]))
    return torch.softmax(warpers(None, logits.double()), dim=-1)


def exact_pair_distribution(model_dir: Path, params: dict[str, float],
                            eos: list[int]) -> dict[tuple[int, int], float]:
    """P(first two tokens); a first token that is EOS ends the sequence: cell (eos, -1)."""
    model = load_causal_lm(str(model_dir), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        first = reference_probs(model(torch.tensor([PROMPT])).logits[0, -1:], params)[0]  # [V]
        vocab = first.shape[0]
        batch = torch.tensor([[*PROMPT, t] for t in range(vocab)])  # [V, len + 1]
        second = reference_probs(model(batch).logits[:, -1], params)  # [V, V]
    cells: dict[tuple[int, int], float] = {}
    for t1 in range(vocab):
        if t1 in eos:
            cells[(t1, -1)] = float(first[t1])
            continue
        for t2 in range(vocab):
            cells[(t1, t2)] = float(first[t1] * second[t1, t2])
    return cells


def sample_pairs(client: SpecDecClient, params: dict[str, float], runs: int) -> Counter:
    counts: Counter = Counter()
    for seed in range(runs):
        ids = client.generate(PROMPT, num_draft_tokens=2, max_new_tokens=3, seed=seed,
                              **params).token_ids  # type: ignore[arg-type]
        counts[(ids[0], ids[1] if len(ids) > 1 else -1)] += 1
    return counts


def chi_square_p(counts: Counter, exact: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(p-value, total variation) of the observed counts against the exact distribution."""
    assert set(counts) <= set(exact), "a pair outside the target's support was generated"
    runs = sum(counts.values())
    expected = np.array([exact[c] * runs for c in exact])
    observed = np.array([counts.get(c, 0) for c in exact], dtype=float)
    small = expected < 5
    expected = np.append(expected[~small], expected[small].sum())
    observed = np.append(observed[~small], observed[small].sum())
    statistic = float(((observed - expected) ** 2 / np.maximum(expected, 1e-12)).sum())
    p_value = float(stats.chi2.sf(statistic, len(expected) - 1))
    tv = 0.5 * sum(abs(counts.get(c, 0) / runs - p) for c, p in exact.items())
    return p_value, tv


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_two_tokens_follow_the_target(name: str, client: SpecDecClient,
                                            tiny_models: dict[str, Path]) -> None:
    params = CONFIGS[name]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, RUNS), exact)
    assert p_value > 1e-3, f"{name}: chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"{name}: TV = {tv:.3f}"


def test_negative_control_accept_everything(client: SpecDecClient,
                                            tiny_models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A deliberately wrong acceptance rule (accept every draft) must fail the same test."""
    def accept_all(target_logprobs, draft_logprobs, log_uniforms):  # type: ignore[no-untyped-def]
        return len(log_uniforms)

    monkeypatch.setattr(sampling, "accept_drafts", accept_all)  # the verifier's copy
    monkeypatch.setattr(speculative, "accept_drafts", accept_all)  # the client's re-check
    params = CONFIGS["T=1"]
    exact = exact_pair_distribution(tiny_models["peaky-target"], params,
                                     client.info.eos_token_ids)
    p_value, tv = chi_square_p(sample_pairs(client, params, CONTROL_RUNS), exact)
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
    p_value, tv = chi_square_p(sample_pairs(client, params, CONTROL_RUNS), exact)
    assert p_value < 1e-6, f"fresh resample not caught: p = {p_value:.2e}, TV = {tv:.3f}"
