"""What a forward costs on the llama.cpp engine, exact kernels next to fast ones, same GGUF file.

One process, both contexts on the same weights: ``kernels="exact"`` (a KV stream per session,
at most 3 rows per ``llama_decode``) and ``kernels="fast"`` (one unified cache, whole batches).
For each session count (1 and 4 sessions, each holding ``--context`` tokens) it times one
forward of n new tokens per session: n = 1 is a one-token step, n = k + 1 a verify block of k
drafts. Rounds alternate the order of the two contexts; the table holds medians, and the ratio
exact / fast within each round's pair. ``--drafter`` also times the drafter's one-token step
(its context is never exact: a drafter only proposes).

    python -m scripts.bench llama-blocks --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from scripts.bench.common import markdown_table, write_json
from shared.engines.llama_cpp.runtime import (
    GGUFWeights,
    LlamaModel,
    Segment,
    exact_kernels,
)
from shared.models.catalog import OFFLINE_MODELS
from shared.models.fetch import fetch_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a .gguf file or a short name of the offline pair")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b",
                        help="also time this GGUF's one-token step (empty: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="cached tokens per session")
    parser.add_argument("--news", type=int, nargs="+", default=[1, 2, 4, 9, 16],
                        help="new tokens per session per forward (k + 1 for k drafts)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_results/llama_blocks.json")


def gguf(spec: str) -> str:
    return str(fetch_gguf(spec)) if spec in OFFLINE_MODELS else spec


def forward_ms(model: LlamaModel, sessions: int, context: int, new: int) -> float:
    """One forward of ``new`` tokens for each of ``sessions`` sequences on ``context`` cached
    tokens each (the new tokens are dropped again, as a rejected block's are)."""
    segments = [Segment(seq, context, [(7 * seq + i) % 1000 + 10 for i in range(new)], 0)
                for seq in range(sessions)]
    started = time.perf_counter()
    model.decode(segments)
    elapsed = (time.perf_counter() - started) * 1000
    for seq in range(sessions):
        model.remove(seq, context)
    return elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    weights = GGUFWeights(gguf(args.target), args.threads)
    most = max(args.sessions)
    seq_tokens = args.context + max(args.news) + 1
    models = {kernels: LlamaModel(weights, n_seqs=most, seq_tokens=seq_tokens,
                                  threads=args.threads, cells=most * seq_tokens,
                                  exact=kernels == "exact") for kernels in ("exact", "fast")}
    for model in models.values():  # every session's cache, written once
        for seq in range(most):
            model.decode([Segment(seq, 0, [(seq + i) % 1000 + 10 for i in range(args.context)])])
        forward_ms(model, 1, args.context, 1)  # warm
    times: dict[tuple[str, int, int], list[float]] = {}
    for round_no in range(args.rounds):
        order = ("exact", "fast") if round_no % 2 == 0 else ("fast", "exact")
        for sessions in args.sessions:
            for new in args.news:
                for kernels in order:
                    times.setdefault((kernels, sessions, new), []).append(
                        forward_ms(models[kernels], sessions, args.context, new))
        print(f"round {round_no}: done", flush=True)
    rows = []
    for sessions in args.sessions:
        step = {k: statistics.median(times[(k, sessions, 1)]) for k in models}
        for new in args.news:
            exact, fast = times[("exact", sessions, new)], times[("fast", sessions, new)]
            rows.append({
                "sessions": sessions, "new_tokens": new,
                "exact_ms": statistics.median(exact), "fast_ms": statistics.median(fast),
                "exact_vs_fast": statistics.median(e / f for e, f in zip(exact, fast,
                                                                         strict=True)),
                "exact_steps": statistics.median(exact) / step["exact"],
                "fast_steps": statistics.median(fast) / step["fast"]})
    table = markdown_table(rows, [
        ("sessions", "sessions"), ("new_tokens", "new tokens each"),
        ("exact_ms", "exact ms"), ("fast_ms", "fast ms"),
        ("exact_vs_fast", "exact / fast (median of pairs)"),
        ("exact_steps", "exact, in one-token steps"), ("fast_steps", "fast, in one-token steps")])
    print(table)
    drafter: dict[str, Any] = {}
    if args.drafter:
        lm = LlamaModel(gguf(args.drafter), n_seqs=1, seq_tokens=seq_tokens,
                        threads=args.threads)
        lm.decode([Segment(0, 0, [i % 1000 + 10 for i in range(args.context)])])
        steps = [forward_ms(lm, 1, args.context, 1) for _ in range(5 * args.rounds)]
        drafter = {"spec": args.drafter, "step_ms": statistics.median(steps)}
        print(f"drafter {args.drafter}: one-token step {drafter['step_ms']:.1f} ms (median)")
    payload = {"command": "python -m scripts.bench llama-blocks", "args": vars(args),
               "exact_kernels": exact_kernels(), "repacked": weights.extra_layouts,
               "rows": rows, "times_ms": {f"{k}|{s}|{n}": v for (k, s, n), v in times.items()},
               "drafter": drafter, "table": table}
    write_json(args.out, payload)
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run(parser.parse_args())
