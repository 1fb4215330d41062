"""Clients built in parallel threads of one process (issue #26): transformers' model load changes
process-wide state (torch's default dtype, a meta-device context), so two loads at once used to
leave the process in bfloat16 or fail with "Cannot copy out of meta tensor". Each client built
in a crowd must draft and generate exactly what the same client built alone does."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from drafter_client.api import DrafterOptions, SpecDecClient
from tests.support.live_server import LiveServer

# (drafter dtype, overlap): bf16 and fp32 model drafters, with and without overlap
CONFIGS = [("bfloat16", False), ("float32", True), ("bfloat16", True), ("float32", False)]


def build_and_generate(url: str, drafter: Path, dtype: str, overlap: bool) -> dict[str, Any]:
    client = SpecDecClient(url, str(drafter), dtype=dtype, options=DrafterOptions(overlap=overlap))
    try:
        result = client.generate([2, 3, 4], max_new_tokens=16, num_draft_tokens=4,
                                 temperature=0)
        sampled = client.generate([5, 6], max_new_tokens=12, num_draft_tokens=3,
                                  temperature=1.0, seed=7)
    finally:
        client.close()
    return {"greedy": result.token_ids, "drafted": result.metrics.drafted_tokens,
            "accepted_at": result.metrics.accepted_at, "sampled": sampled.token_ids,
            "sampled_accepted_at": sampled.metrics.accepted_at}


def build_in_a_crowd(url: str, drafter: Path) -> list[dict[str, Any] | None]:
    """Every config's client built and run in its own thread, all released at once."""
    results: list[dict[str, Any] | None] = [None] * len(CONFIGS)
    errors: list[BaseException] = []
    start = threading.Barrier(len(CONFIGS))

    def build(i: int) -> None:
        try:
            start.wait()
            results[i] = build_and_generate(url, drafter, *CONFIGS[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(len(CONFIGS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def test_clients_built_in_four_threads_at_once_draft_what_one_built_alone_does(
        gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> None:
    drafter = tiny_models["gpt2-drafter"]
    alone = [build_and_generate(gpt2_server.url, drafter, *config) for config in CONFIGS]
    default_dtype = torch.get_default_dtype()
    for _ in range(2):
        assert build_in_a_crowd(gpt2_server.url, drafter) == alone
        assert torch.get_default_dtype() == default_dtype
