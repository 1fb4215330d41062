"""The two attention layouts over the KV pool (kv_pool.py) give one model's logits: a mixed batch
- a long prefill, chains of several lengths, a token tree, a decode step - forwarded with
``padded`` attention equals the same batch ``per-session`` and each item forwarded alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engines.target import ForwardItem
from shared.engines.transformers.kv_pool import PADDED_MAX_LENGTH
from shared.engines.transformers.target import CausalEngine
from shared.models.catalog import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module", params=["gpt2-target", "llama-target"])
def runner(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> CausalEngine:
    path = tiny_models[request.param]
    return CausalEngine(load_causal_lm(str(path), torch.float32, torch.device("cpu")),
                        load_tokenizer(str(path)), str(path), max_context=256,
                        kv_budget_tokens=256 * 8)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 64 for i in range(n)]


def mixed_batch(runner: CausalEngine) -> list[ForwardItem]:
    """Six slots with cached prefixes of different lengths, then one batch of every kind."""
    slots = [runner.allocate() for _ in range(6)]
    assert all(s is not None for s in slots)
    prefixes = [40, 3, 17, 90, 1, 0]
    for slot, n in zip(slots, prefixes, strict=True):
        if n:
            runner.forward([ForwardItem(slot, 0, ids(n, slot or 0), False)])  # type: ignore[arg-type]
    s = [int(x) for x in slots if x is not None]
    return [
        ForwardItem(s[0], 40, ids(5, 1), True),  # a verify block, k = 4
        ForwardItem(s[1], 3, ids(1, 2), True),  # a decode step
        ForwardItem(s[2], 17, ids(7, 3), True, tree_parents=[-1, 0, 0, 1, -1, 4]),  # a tree
        ForwardItem(s[3], 90, ids(17, 4), True),  # a long verify block
        ForwardItem(s[4], 1, ids(2, 5), True),
        ForwardItem(s[5], 0, ids(PADDED_MAX_LENGTH + 30, 6), True),  # a prefill: attends alone
    ]


def test_padded_attention_equals_per_session_and_alone(runner: CausalEngine) -> None:
    items = mixed_batch(runner)
    results = {}
    for mode in ("per-session", "padded"):
        runner.attention = mode
        results[mode] = [r.clone() for r in runner.forward(items)]  # type: ignore[union-attr]
    runner.attention = "per-session"
    alone = [runner.forward([item])[0] for item in items]
    for padded, per_session, single in zip(results["padded"], results["per-session"], alone,
                                           strict=True):
        assert padded is not None and per_session is not None and single is not None
        torch.testing.assert_close(padded, per_session, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded, single, rtol=1e-5, atol=1e-5)
        assert torch.equal(padded.argmax(-1), single.argmax(-1))
