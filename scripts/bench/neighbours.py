"""What one client's verify calls cost another's: an ordinary client's verify latency beside an
ordinary neighbour, and beside neighbours that ask the most per-call work the protocol allows.

One verifier (its own process, the target's GGUF file on the default engine), two clients at
once for ``--seconds`` each pairing, each in its own session of a ``--prompt``-token prompt:

* ``ordinary``: blocks of ``-k`` drafts, greedy, nothing else;
* ``16 drafts``: blocks of 16 drafts, nothing else (a larger share of each forward: the
  baseline of the next);
* ``masks``: the same blocks with a row mask on each of the 17 rows (``--allowed`` ids of the
  vocabulary each, a free-text pattern's count on Qwen2.5's 151,936 ids);
* ``history``: presence and frequency penalties with a history as long as the verifier takes
  (as many ids as the session's position), and one call a round whose history is 90,000 ids
  (refused: ``history_too_long``).

The table: the ordinary client's p50 / p90 verify ms beside each neighbour, its p50 over its p50
beside an ordinary neighbour (masks: beside 16 plain drafts, the same rows), and the neighbour's
own calls (p50 ms, statuses). Each session's first call (its prompt's write) is not timed.
Rounds rotate the neighbours' order.

    python -m scripts.bench neighbours --seconds 8 --rounds 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np

from scripts.bench.common import markdown_table, write_json
from shared.machine_cache import cpu_flags, cpu_name
from shared.protocol.schema import RowMask

KINDS = ("ordinary", "16 drafts", "masks", "history")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name whose GGUF file is kept, or a .gguf path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-k", type=int, default=4, help="the ordinary client's drafts a block")
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens a session")
    parser.add_argument("--allowed", type=int, default=41_762, help="ids a mask allows")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench_results/neighbours.json")


class Client:
    """One session and its verify calls, timed."""

    def __init__(self, http: httpx.Client, kind: str, args: argparse.Namespace, vocab: int,
                 seed: int) -> None:
        self.http, self.kind, self.args, self.vocab = http, kind, args, vocab
        self.rng = random.Random(seed)
        sampling = ({"presence_penalty": 0.5, "frequency_penalty": 0.5}
                    if kind == "history" else {})
        prompt = [self.rng.randrange(100, 30000) for _ in range(args.prompt)]
        opened = http.post("/v1/sessions", json={"prompt_ids": prompt, "sampling": sampling})
        opened.raise_for_status()
        self.session, self.position, self.last = opened.json()["session_id"], len(prompt), \
            prompt[-1]
        self.ms: list[float] = []
        self.statuses: Counter[int] = Counter()
        self.masks: list[dict[str, Any]] = []
        if kind == "masks":
            generator = np.random.default_rng(seed)
            for _ in range(17):
                keep = np.zeros(vocab, dtype=bool)
                keep[generator.choice(vocab, args.allowed, replace=False)] = True
                self.masks.append(RowMask.of(keep).model_dump(exclude_none=True))

    def body(self, oversized: bool = False) -> dict[str, Any]:
        k = 16 if self.kind in ("masks", "16 drafts") else self.args.k
        drafts = [self.rng.randrange(100, 30000) for _ in range(k)]
        body: dict[str, Any] = {"position": self.position, "last_token": self.last,
                                "draft_ids": drafts, "log_uniforms": [-0.1] * k,
                                "final_uniform": 0.5}
        if self.kind == "masks":
            body["masks"] = self.masks
        if self.kind == "history":
            count = 90_000 if oversized else self.position
            ids = self.rng.sample(range(self.vocab), min(count, self.vocab))
            body["history"] = [[i, 1] for i in ids]
        return body

    def call(self, oversized: bool = False) -> None:
        started = time.perf_counter()
        answer = self.http.post(f"/v1/sessions/{self.session}/verify",
                                json=self.body(oversized))
        self.statuses[answer.status_code] += 1
        if answer.status_code == 200:
            reply = answer.json()
            self.ms.append(1000 * (time.perf_counter() - started))
            self.position, self.last = reply["position"], reply["next_token"]

    def loop(self, until: float) -> None:
        n = 0
        while time.perf_counter() < until:
            self.call(oversized=self.kind == "history" and n % 10 == 9)
            n += 1


def pairing(url: str, kind: str, args: argparse.Namespace, vocab: int,
            seed: int) -> tuple[Client, Client]:
    with httpx.Client(base_url=url, timeout=120) as a, httpx.Client(base_url=url,
                                                                  timeout=120) as b:
        ours, theirs = Client(a, "ordinary", args, vocab, seed), Client(b, kind, args, vocab,
                                                                         seed + 1)
        for c in (ours, theirs):  # the prompt's write, untimed
            c.call()
            c.ms.clear()
            c.statuses.clear()
        until = time.perf_counter() + args.seconds
        threads = [threading.Thread(target=c.loop, args=(until,)) for c in (ours, theirs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in (ours, theirs):
            a.delete(f"/v1/sessions/{c.session}")
    return ours, theirs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared.engines.llama_cpp.runtime import resolve_gguf
    from verifier_service.launch import VerifierProcess

    path = resolve_gguf(args.target)[0]
    ours_ms: dict[str, list[float]] = {k: [] for k in KINDS}
    theirs_ms: dict[str, list[float]] = {k: [] for k in KINDS}
    statuses: dict[str, Counter[int]] = {k: Counter() for k in KINDS}
    with VerifierProcess(["--model", path, "--max-context", "4096"],
                         threads=args.threads) as verifier:
        vocab = int(httpx.get(f"{verifier.url}/v1/info").json()["vocab_size"])
        for round_no in range(args.rounds):
            order = KINDS[round_no % 4:] + KINDS[:round_no % 4]
            for kind in order:
                ours, theirs = pairing(verifier.url, kind, args, vocab, 10 * round_no)
                ours_ms[kind] += ours.ms
                theirs_ms[kind] += theirs.ms
                statuses[kind] += theirs.statuses
            print(f"round {round_no}: done", flush=True)
    rows = []
    for kind in KINDS:
        p50 = statistics.median(ours_ms[kind])
        base = statistics.median(ours_ms["16 drafts" if kind == "masks" else "ordinary"])
        rows.append({"neighbour": kind, "ordinary p50 ms": p50,
                     "ordinary p90 ms": float(np.percentile(ours_ms[kind], 90)),
                     "x its baseline": p50 / base, "ordinary calls": len(ours_ms[kind]),
                     "neighbour p50 ms": statistics.median(theirs_ms[kind])
                     if theirs_ms[kind] else None,
                     "neighbour statuses": dict(sorted(statuses[kind].items()))})
    table = markdown_table(rows, [(key, key) for key in rows[0]])
    print(table)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    payload = {"command": "python -m scripts.bench neighbours", "args": vars(args),
               "cpu": cpu_name(), "cpu_flags": flags, "rows": rows, "table": table}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run it as python -m scripts.bench neighbours")
