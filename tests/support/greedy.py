"""Greedy speculation against the target alone on one verifier: the exactness tests' check."""

from __future__ import annotations

import threading
from pathlib import Path

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions

KS: tuple[int | str, ...] = (1, 3, 8, "auto")


def target_alone(url: str, tokenizer: str, prompts: list[list[int]],
                 new_tokens: int) -> list[list[int]]:
    """The target alone's greedy tokens for each prompt (``baseline``, one session at a time)."""
    alone = SpecDecClient(url, None, tokenizer=tokenizer)
    return [alone.baseline(ids, max_new_tokens=new_tokens).token_ids for ids in prompts]


def speculative_vs_alone(url: str, drafter: Path, tokenizer: str, prompts: list[list[int]],
                         new_tokens: int, loads: tuple[int, ...],
                         options: DrafterOptions | None = None, ks: tuple[int | str, ...] = KS,
                         want: list[list[int]] | None = None) -> list[str]:
    """Greedy generations that differ from the target alone's (``want``, or ``target_alone``
    on the same verifier), under each load: 1 is every prompt alone at each k; n > 1 is n
    sessions at once at mixed k (the verifier batches their calls into shared forwards)."""
    if want is None:
        want = target_alone(url, tokenizer, prompts, new_tokens)
    differ: list[str] = []
    for sessions in loads:
        if sessions == 1:
            client = SpecDecClient(url, str(drafter), options=options)
            differ += [f"prompt {i} alone k={k}" for k in ks for i, ids in enumerate(prompts)
                       if client.generate(ids, num_draft_tokens=k,
                                          max_new_tokens=new_tokens).token_ids != want[i]]
        else:
            differ += _at_once(url, drafter, prompts, new_tokens, sessions, options, ks, want)
    return differ


def _at_once(url: str, drafter: Path, prompts: list[list[int]], new_tokens: int,
             sessions: int, options: DrafterOptions | None, ks: tuple[int | str, ...],
             want: list[list[int]]) -> list[str]:
    clients = [SpecDecClient(url, str(drafter), options=options) for _ in range(sessions)]
    results: dict[int, list[int]] = {}

    def work(j: int) -> None:
        results[j] = clients[j].generate(prompts[j % len(prompts)],
                                         num_draft_tokens=ks[j % len(ks)],
                                         max_new_tokens=new_tokens).token_ids

    threads = [threading.Thread(target=work, args=(j,)) for j in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [f"prompt {j % len(prompts)} among {sessions}"
            for j in range(sessions) if results.get(j) != want[j % len(prompts)]]
