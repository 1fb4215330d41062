"""Greedy speculation against the target alone on one verifier: the exactness tests' check."""

from __future__ import annotations

import threading
from pathlib import Path

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions


def speculative_vs_alone(url: str, drafter: Path, tokenizer: str, prompts: list[list[int]],
                         new_tokens: int, concurrent: int,
                         options: DrafterOptions | None = None,
                         ks: tuple[int | str, ...] = (1, 3, 8, "auto")) -> list[str]:
    """Greedy generations that differ from the target alone's (``baseline``, one session at a
    time, on the same verifier): every prompt alone at each k, then ``concurrent`` sessions at
    once at mixed k (the verifier batches their calls into shared forwards)."""
    alone = SpecDecClient(url, None, tokenizer=tokenizer)
    want = [alone.baseline(ids, max_new_tokens=new_tokens).token_ids for ids in prompts]
    client = SpecDecClient(url, str(drafter), options=options)
    differ = [f"prompt {i} alone k={k}" for k in ks for i, ids in enumerate(prompts)
              if client.generate(ids, num_draft_tokens=k, max_new_tokens=new_tokens).token_ids
              != want[i]]
    if concurrent > 1:
        clients = [SpecDecClient(url, str(drafter), options=options) for _ in range(concurrent)]
        results: dict[int, list[int]] = {}

        def work(j: int) -> None:
            results[j] = clients[j].generate(prompts[j % len(prompts)],
                                             num_draft_tokens=ks[j % len(ks)],
                                             max_new_tokens=new_tokens).token_ids

        threads = [threading.Thread(target=work, args=(j,)) for j in range(concurrent)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        differ += [f"prompt {j % len(prompts)} among {concurrent}"
                   for j in range(concurrent) if results.get(j) != want[j % len(prompts)]]
    return differ
