"""The capacity remote drafting buys: N clients whose drafting costs the verifier's machine
nothing, beside ``llama-server -np N`` and our target alone on the same machine.

Each client's drafter replays the target's own greedy answer to its prompt (recorded through
``/v1/generate`` before the clock starts), each drafted token kept with probability
``acceptance`` and otherwise replaced by another id (:class:`ReplayDrafter`): what a drafter on
the user's machine with that acceptance rate costs this machine - nothing. Every block is still
verified, so every output is checked against the target alone's (greedy identity under load).
``-k auto``: the client's cost model picks k from the verifier's costs and its load.

    python -m scripts.bench capacity --clients 1 4 8 16 --rounds 2

Runs ``scripts.bench serving`` with the systems ``llama-server``, ``alone`` and ``replay-0.5 /
0.7 / 0.9``, then prints, per N and acceptance, the served tok/s against ``llama-server -np N``
and against our target alone, each client's tok/s, and a check of where the time went: the
capacity the verifier's forwards alone would give (output tokens per second of forward time,
over the target alone's), against the measured one.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import torch

from scripts.bench import serving
from scripts.bench.common import markdown_table, write_json
from shared.engines.drafter import Draft, Drafter, DrafterCosts
from shared.protocol.sampling import SamplingConfig

SYSTEMS = ["llama-server", "alone", "replay-0.5", "replay-0.7", "replay-0.9"]


class ReplayDrafter(Drafter):
    """Drafts the target's recorded greedy answer to the prompt, each token kept with
    probability ``acceptance`` (else the next id): a free drafter with a set acceptance rate.
    A prompt it has no answer for gets no drafts."""

    name = "replay"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], acceptance: float,
                 vocab_size: int, seed: int = 0) -> None:
        self.answers, self.acceptance, self.vocab_size = answers, acceptance, vocab_size
        self.rng = random.Random(seed)
        self.answer: list[int] = []
        self.done = 0

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.answer, self.done = self.answers.get(tuple(prompt_ids), []), 0

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        drafts = []
        for token in self.answer[self.done:self.done + k]:
            kept = self.rng.random() < self.acceptance
            drafts.append(token if kept else (token + 1) % self.vocab_size)
        return Draft(drafts, None, None)

    def commit(self, tokens: list[int]) -> None:
        self.done += len(tokens)

    def costs(self) -> DrafterCosts:
        return DrafterCosts(draft_s_per_token=0.0, free_draft=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving.add_arguments(parser)
    parser.set_defaults(systems=SYSTEMS, clients=[1, 4, 8, 16], rounds=2,
                        out="bench_results/capacity.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    payload = serving.run(args)
    rows = []
    for n in args.clients:
        def of(system: str, n: int = n) -> dict[str, Any] | None:
            return next((r for r in payload["rows"]
                         if r["clients"] == n and r["system"] == system), None)

        def forward_rate(system: str, n: int = n) -> float | None:
            """Output tokens per second of the verifier's forward time."""
            steps = [s for s in payload["verifier_steps"]
                     if s["clients"] == n and s["system"] == system]
            tokens = sum(len(r["tokens"]) for r in payload["runs"]
                         if r["clients"] == n and r["system"] == system)
            seconds = sum(s["forward_s"] for s in steps)
            return tokens / seconds if seconds else None

        alone, peer = of("alone"), of("llama-server")
        for system in [s for s in args.systems if s.startswith(serving.REPLAY)]:
            mine = of(system)
            if mine is None or alone is None:
                continue
            clients = [len(r["tokens"]) / r["wall_s"] for r in payload["runs"]
                       if r["clients"] == n and r["system"] == system]
            rate, base = forward_rate(system), forward_rate("alone")
            rows.append({
                "clients": n, "acceptance_set": float(system.removeprefix(serving.REPLAY)),
                "acceptance": mine["acceptance"], "tok_s": mine["tok_s"],
                "vs_llama_server": mine["vs_llama_server"],
                "llama_server_tok_s": peer["tok_s"] if peer else None,
                "vs_alone": mine["tok_s"] / alone["tok_s"],
                "forwards_vs_alone": rate / base if rate and base else None,
                "client_tok_s_p50": statistics.median(clients),
                "same_as_alone": mine["same_as_alone"]})
    table = markdown_table(rows, [
        ("clients", "N"), ("acceptance_set", "acceptance set"),
        ("acceptance", "accepted / drafted"), ("tok_s", "served tok/s"),
        ("llama_server_tok_s", "llama-server -np N tok/s"),
        ("vs_llama_server", "vs llama-server"), ("vs_alone", "vs our target alone"),
        ("forwards_vs_alone", "forwards alone would give"),
        ("client_tok_s_p50", "each client's tok/s (p50)"),
        ("same_as_alone", "output = alone's")])
    print("\n" + table)
    payload.update({"capacity_rows": rows, "capacity_table": table})
    write_json(args.out, payload)
    return payload
