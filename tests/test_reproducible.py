"""Reproducible sampling (``--reproducible``): with noise shared by drafter and target per
position (Gumbel-max coupling, Daliri et al. 2024), sampled output is identical to the target
alone's with the same seed, whatever the drafter, k, tree, overlap or batching."""

from __future__ import annotations

import pytest
import torch

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from shared.protocol.sampling import SamplingConfig, coupled_tokens, gumbel_noise

PROMPTS = ["the cat sat on", "def x ( y ) :", "the cat sat on the mat the cat sat on"]
SAMPLING = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.3, "top_k": 8}]


def test_noise_depends_on_seed_and_position_only() -> None:
    a = gumbel_noise(3, 10, 50)
    assert torch.equal(a, gumbel_noise(3, 10, 50))
    assert not torch.equal(a, gumbel_noise(3, 11, 50))
    assert not torch.equal(a, gumbel_noise(4, 10, 50))
    logits = torch.randn(2, 50)
    config = SamplingConfig(temperature=1.0, coupling_seed=3)
    assert torch.equal(coupled_tokens(logits, config, [10, 11]),
                       torch.argmax(torch.log_softmax(logits.double(), -1)
                                    + torch.stack([a, gumbel_noise(3, 11, 50)]), -1))


@pytest.mark.parametrize(("drafter", "options"), [
    ("model", DrafterOptions(lookup=False)),
    ("model", DrafterOptions(lookup=False, tree_width=2, overlap=True)),
    ("model", DrafterOptions(lookup=True)),
    ("ngram", DrafterOptions()),
], ids=["model", "model-tree-overlap", "hybrid", "ngram"])
def test_reproducible_output_equals_the_target_alone(drafter, options, tiny_models,  # type: ignore[no-untyped-def]
                                                     llama_server):
    spec = str(tiny_models["llama-drafter"]) if drafter == "model" else drafter
    client = SpecDecClient(llama_server.url, spec, dtype="float32", device="cpu",
                           options=options, tokenizer=str(tiny_models["llama-target"]))
    accepted = 0
    for prompt, params in zip(PROMPTS, SAMPLING, strict=True):
        ids = client.encode(prompt)
        for seed in (0, 1):
            alone = client.baseline(ids, max_new_tokens=20, seed=seed, reproducible=True,
                                    **params).token_ids  # type: ignore[arg-type]
            for k in (1, 4):
                result = client.generate(ids, num_draft_tokens=k, max_new_tokens=20, seed=seed,
                                         reproducible=True, **params)  # type: ignore[arg-type]
                assert result.token_ids == alone, f"{prompt!r} {params} seed={seed} k={k}"
                accepted += result.metrics.accepted_tokens
    assert accepted > 0
    # A different seed gives a different sample (the noise is not ignored).
    ids = client.encode(PROMPTS[0])
    outputs = {tuple(client.baseline(ids, max_new_tokens=12, seed=s, reproducible=True,
                                     temperature=1.0).token_ids) for s in range(4)}
    assert len(outputs) > 1
