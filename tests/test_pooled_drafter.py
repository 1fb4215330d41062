"""The pooled drafter (``--cuda-graphs`` on the client,
shared/engines/transformers/pooled_drafter.py) drafts what the plain transformers drafter drafts,
through its static one-token steps (run eagerly on this CPU), across accepted, rejected and partly
accepted blocks; and greedy output through a verifier stays the target's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from shared.engines.transformers.drafter import HFDrafter
from shared.engines.transformers.pooled_drafter import DrafterContextError, PooledDrafter
from shared.models.catalog import load_causal_lm
from shared.protocol.sampling import SamplingConfig
from tests.support.tiny_models import hf_greedy

PROMPT = [5, 9, 14, 3, 22, 7]


def _pair(path: Path, slot_tokens: int = 128) -> tuple[HFDrafter, PooledDrafter]:
    # Two copies of one checkpoint: the pooled drafter switches its model's attention.
    plain = load_causal_lm(str(path), torch.float32, torch.device("cpu"))
    pooled = load_causal_lm(str(path), torch.float32, torch.device("cpu"))
    vocab = int(plain.get_output_embeddings().weight.shape[0])
    return HFDrafter(plain, vocab), PooledDrafter(pooled, vocab, slot_tokens, capture=False)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pooled_drafts_equal_the_plain_drafter(arch: str, temperature: float,
                                               tiny_models: dict[str, Path]) -> None:
    plain, pooled = _pair(tiny_models[f"{arch}-drafter"])
    config = SamplingConfig(temperature=temperature)
    for drafter in (plain, pooled):
        drafter.reset(PROMPT)
    # What the verifier "accepts" of each block: all, none, some; then the bonus token 11.
    for block, accepted in enumerate([4, 0, 2, 4, 1, 3]):
        seed = 100 + block
        a = plain.propose(4, config, torch.Generator().manual_seed(seed))
        b = pooled.propose(4, config, torch.Generator().manual_seed(seed))
        assert a.ids == b.ids, f"block {block}"
        if temperature:
            assert a.logprobs is not None and b.logprobs is not None
            assert a.probs is not None and b.probs is not None
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)
        for drafter in (plain, pooled):
            drafter.commit([*a.ids[:accepted], 11])
        assert pooled.cached == plain.cached
    assert pooled.static.replays > 0  # the one-token steps ran in the static bucket


def test_pooled_speculation_and_trees_equal_the_plain_drafter(
        tiny_models: dict[str, Path]) -> None:
    plain, pooled = _pair(tiny_models["llama-drafter"])
    greedy = SamplingConfig()
    for drafter in (plain, pooled):
        drafter.reset(PROMPT)
    first = plain.propose(3, greedy, torch.Generator())
    assert pooled.propose(3, greedy, torch.Generator()).ids == first.ids
    ahead = plain.speculate(first.ids, 3, greedy, torch.Generator())
    assert ahead is not None
    assert pooled.speculate(first.ids, 3, greedy, torch.Generator()) == ahead
    for drafter in (plain, pooled):
        drafter.commit([*first.ids, ahead[0]])
        drafter.tree_width = 3
    assert pooled.propose(3, greedy, torch.Generator()) == plain.propose(3, greedy,
                                                                         torch.Generator())


def test_a_full_slot_is_a_clear_error(tiny_models: dict[str, Path]) -> None:
    _, pooled = _pair(tiny_models["llama-drafter"], slot_tokens=12)
    pooled.reset(PROMPT)
    pooled.propose(4, SamplingConfig(), torch.Generator())  # 6 + 3 tokens fit
    with pytest.raises(DrafterContextError, match="holds 12 tokens"):
        pooled.propose(8, SamplingConfig(), torch.Generator())


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_through_a_verifier_is_the_targets(overlap: bool, tiny_models: dict[str, Path],
                                                   llama_server: object) -> None:
    url = llama_server.url  # type: ignore[attr-defined]
    client = SpecDecClient(url, str(tiny_models["llama-drafter"]), dtype="float32",
                           device="cpu", options=DrafterOptions(lookup=False, cuda_graphs=True,
                                                                overlap=overlap))
    assert isinstance(client.drafter, PooledDrafter)
    with pytest.raises(Exception, match="cannot change cuda_graphs"):
        client.with_options(DrafterOptions(lookup=False))
    for prompt in ["the cat sat on", "a big red dog ran to the"]:
        ids = client.encode(prompt)
        result = client.generate(ids, num_draft_tokens=4, max_new_tokens=24)
        expected = hf_greedy(tiny_models["llama-target"], ids, 24)
        eos = client.info.eos_token_ids
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        assert result.token_ids == expected[:cut], prompt
