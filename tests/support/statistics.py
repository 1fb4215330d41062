"""The statistics of the distribution tests: the exact probability of the first two generated
tokens (from the target itself, processed with transformers' logits warpers, an independent
implementation), seeded speculative draws, and the chi-square / total-variation comparison."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import shared.protocol.acceptance as rule
from drafter_client import SpecDecClient
from shared.models.catalog import load_causal_lm
from tests.support.in_process import CallGroup, InProcessVerifier

PROMPT = [2, 3, 4]  # "the cat sat"
# Client threads whose draws share the in-process verifier's forwards: worth it for model-free
# drafters, whose drafting costs next to nothing; a model drafter's forwards on 8 threads under
# one GIL cost what the shared verifier forwards save.
MODEL_FREE_WORKERS = 8


def reference_probs(logits: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] probs with transformers' warpers (not our code)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params["temperature"])])
    if params.get("top_k"):
        warpers.append(TopKLogitsWarper(int(params["top_k"])))
    if params.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(params["top_p"]))
    return torch.softmax(warpers(None, logits.double()), dim=-1)


def exact_pair_distribution(model_dir: Path, params: dict[str, float], eos: list[int],
                            prompt: list[int] = PROMPT) -> dict[tuple[int, ...], float]:
    """P(first two tokens); a first token that is EOS ends the sequence: cell (eos, -1)."""
    return exact_token_distribution(model_dir, params, eos, prompt, n=2)


def exact_token_distribution(model_dir: Path, params: dict[str, float], eos: list[int],
                             prompt: list[int] = PROMPT, n: int = 3
                             ) -> dict[tuple[int, ...], float]:
    """P(first n tokens), enumerated over every prefix (V^(n-1) rows at the last depth); a
    sequence ends at an EOS: the cells after it are -1."""
    model = load_causal_lm(str(model_dir), torch.float32, torch.device("cpu"))
    cells: dict[tuple[int, ...], float] = {(): 1.0}
    live = [()]  # prefixes without an EOS, still growing
    with torch.no_grad():
        for _ in range(n):
            batch = torch.tensor([[*prompt, *prefix] for prefix in live])
            probs = reference_probs(model(batch).logits[:, -1], params)  # [prefixes, V]
            grown: list[tuple[int, ...]] = []
            for row, prefix in enumerate(live):
                mass = cells.pop(prefix)
                for t in range(probs.shape[1]):
                    cells[(*prefix, t)] = mass * float(probs[row, t])
                    if t not in eos:
                        grown.append((*prefix, t))
            live = grown
    return {cell + (-1,) * (n - len(cell)): p for cell, p in cells.items()}


def pair_cells(first: torch.Tensor, second: torch.Tensor,
               eos: list[int]) -> dict[tuple[int, int], float]:
    """[V] P(t1) and [V, V] P(t2 | t1) -> P(t1, t2); an EOS first token ends the sequence: its
    cell is (eos, -1)."""
    cells: dict[tuple[int, int], float] = {}
    for t1 in range(first.shape[0]):
        if t1 in eos:
            cells[(t1, -1)] = float(first[t1])
            continue
        for t2 in range(first.shape[0]):
            cells[(t1, t2)] = float(first[t1] * second[t1, t2])
    return cells


def accept_everything(monkeypatch: Any) -> None:
    """A deliberately wrong acceptance rule (every draft passes the ratio test): the negative
    control the tests must catch. The rule is written once (``shared/protocol/acceptance.py``),
    so one patch changes it in the verifier's batched path, its reference path and the client's
    re-check alike."""
    monkeypatch.setattr(rule, "ratio_test",
                        lambda target_lp, draft_lp, log_u: torch.ones_like(log_u, dtype=torch.bool))


def first_tokens(client: SpecDecClient, prompt: list[int], seed: int, k: int | str,
                 params: dict[str, Any], n: int = 2) -> tuple[int, ...]:
    """One seeded draw of the first n tokens (-1 after an EOS that ends the sequence).

    It asks for n + 1 tokens, so that the block after the first can still draft (a block
    leaves room for its bonus token), and stops once n are committed: the tokens after the
    counted ones are never drawn. Stopping on a count of committed tokens leaves their
    distribution unchanged."""
    committed = 0

    def counted(outcome: Any) -> bool:
        nonlocal committed
        committed += len(outcome.tokens)
        return committed >= n

    ids = client.generate(prompt, num_draft_tokens=k, max_new_tokens=n + 1, seed=seed,
                          on_block=counted, **params).token_ids
    return tuple(ids[i] if i < len(ids) else -1 for i in range(n))


def sample_pairs(client: SpecDecClient, params: dict[str, float], runs: int,
                 prompt: list[int] = PROMPT, k: int | str = 2, seeds: range | None = None,
                 exact: dict[tuple[int, ...], float] | None = None,
                 stop_below: float = 1e-6, every: int = 250, workers: int = 1,
                 n: int = 2) -> Counter:
    """``runs`` seeded draws of the first ``n`` tokens (seeds 0..runs - 1, or ``seeds``).

    Against an in-process verifier the draws run on ``workers`` forks of the client, one thread
    each, whose calls share the verifier's batched forwards (``CallGroup``); each seed's draw
    is the same whichever fork makes it, up to the rounding of a batched forward.

    With ``exact`` (a negative control): a chi-square test every ``every`` draws, stopping as
    soon as its p-value is below ``stop_below`` - the wrong rule is caught, and more draws
    could only make p smaller. A correct rule never stops early (its tests take no ``exact``),
    so their power and error rate are those of all ``runs`` draws."""
    order = list(seeds if seeds is not None else range(runs))
    verifier = client.verifier
    forks = ([client, *(client.fork() for _ in range(workers - 1))]
             if isinstance(verifier, InProcessVerifier) and workers > 1 else [client])
    counts: Counter = Counter()
    step = every if exact is not None else len(order)
    for start in range(0, len(order), step):
        chunk = order[start:start + step]
        if len(forks) == 1:
            counts.update(first_tokens(client, prompt, seed, k, params, n) for seed in chunk)
        else:
            counts.update(_draw_together(forks, verifier, chunk, prompt, k, params, n))
        if (exact is not None and start + step < len(order)
                and _p_value(counts, exact) < stop_below):
            break
    return counts


def _draw_together(forks: list[SpecDecClient], verifier: Any, seeds: list[int],
                   prompt: list[int], k: int | str, params: dict[str, Any], n: int) -> Counter:
    members = min(len(forks), len(seeds))
    verifier.group = CallGroup(verifier.engine, members)
    found: list[Counter] = [Counter() for _ in range(members)]
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for seed in seeds[index::members]:
                found[index][first_tokens(forks[index], prompt, seed, k, params, n)] += 1
        except BaseException as exc:  # reported below, after the others finish
            errors.append(exc)
        finally:
            verifier.group.leave()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(members)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        verifier.group = None
    if errors:
        raise errors[0]
    total: Counter = Counter()
    for part in found:
        total.update(part)
    return total


def _pooled(counts: Counter, exact: dict[tuple[int, ...], float]) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts per cell, cells with expected count < 5 pooled in one."""
    assert set(counts) <= set(exact), "a pair outside the target's support was generated"
    runs = sum(counts.values())
    expected = np.array([exact[c] * runs for c in exact])
    observed = np.array([counts.get(c, 0) for c in exact], dtype=float)
    small = expected < 5
    return (np.append(observed[~small], observed[small].sum()),
            np.append(expected[~small], expected[small].sum()))


def _p_value(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    observed, expected = _pooled(counts, exact)
    statistic = float(((observed - expected) ** 2 / np.maximum(expected, 1e-12)).sum())
    return float(stats.chi2.sf(statistic, len(expected) - 1))


def chi_square_p(counts: Counter, exact: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """(p-value, total variation) of the observed counts against the exact distribution."""
    p_value = _p_value(counts, exact)
    runs = sum(counts.values())
    tv = 0.5 * sum(abs(counts.get(c, 0) / runs - p) for c, p in exact.items())
    print(f"\n{runs} draws: chi-square p = {p_value:.3g}, total variation = {tv:.4f}")
    return p_value, tv
