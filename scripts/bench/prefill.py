"""How fast a prompt is written: the w4a8 engine (each of its kernel paths) next to
``llama-server`` with ``cache_prompt`` off, on the same Q4_K_M file and threads.

For each prompt length it times one prompt written into an empty session, as the verifier
writes a new session's prompt (the engine's ``forward`` of the whole prompt, in its chunks, the
last row's logits kept), and llama-server's own ``prompt_ms`` for the same token ids with
``n_predict`` 1. Every round runs every system in turn, in rotating order; the table holds
medians in tokens a second and each system's ratio to llama-server in the same round.

    python -m scripts.bench prefill --lengths 256 1024 2048 --rounds 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from scripts.bench.common import markdown_table, write_json
from shared.engines.target import ForwardItem
from shared.machine_cache import cpu_flags, cpu_name

LLAMA = "llama-server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name of the offline pair whose GGUF file is kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=["w4a8", "w4a8 avx2", LLAMA],
                        choices=["w4a8", "w4a8 avx2", "w4a8 portable", LLAMA],
                        help="w4a8: the engine on the best path this CPU runs; w4a8 avx2 / "
                        "portable: on that path; llama-server: cache_prompt off")
    parser.add_argument("--out", default="bench_results/prefill.json")


def prompt(length: int, seed: int) -> list[int]:
    """``length`` ids from the vocabulary's common range (fixed by ``seed``)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(length)]


def ours_s(engine: Any, ids: list[int]) -> float:
    slot = engine.allocate()
    assert slot is not None
    try:
        started = time.perf_counter()
        engine.forward([ForwardItem(slot, 0, ids, True, keep_from=len(ids) - 1)])
        return time.perf_counter() - started
    finally:
        engine.release(slot)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.bench.cpu_blocks import load, use_path

    systems: dict[str, Any] = {}
    for name in args.systems:
        if name == LLAMA:
            from scripts.bench.llama import LlamaServer, gguf_of, llama_server_binary

            systems[name] = LlamaServer(llama_server_binary(), gguf_of(args.target),
                                        args.threads, [])
        else:
            args.context, args.news, args.sessions = max(args.lengths), [1], [1]
            systems[name] = load(name, args)[0]
    seconds: dict[tuple[str, int], list[float]] = {}
    names = list(systems)
    try:
        for name in names:  # warm each once
            if name == LLAMA:
                systems[name].generate(prompt(64, 0), 1)
            else:
                use_path(name)
                ours_s(systems[name], prompt(64, 0))
        for round_no in range(args.rounds):
            order = names[round_no % len(names):] + names[:round_no % len(names)]
            for length in args.lengths:
                ids = prompt(length, round_no + 1)
                for name in order:
                    if name == LLAMA:
                        took = systems[name].generate(ids, 1)["prompt_s"]
                    else:
                        use_path(name)
                        took = ours_s(systems[name], ids)
                    seconds.setdefault((name, length), []).append(took)
            print(f"round {round_no}: done", flush=True)
    finally:
        if LLAMA in systems:
            systems[LLAMA].close()
    rows = []
    for length in args.lengths:
        row: dict[str, Any] = {"prompt_tokens": length}
        for name in names:
            row[f"{name} tok/s"] = length / statistics.median(seconds[(name, length)])
            if LLAMA in systems:
                ratios = [peer / own for own, peer in zip(seconds[(name, length)],
                                                          seconds[(LLAMA, length)], strict=True)]
                row[f"{name} x"] = statistics.median(ratios)
        rows.append(row)
    columns = [("prompt_tokens", "prompt tokens")]
    for name in names:
        columns.append((f"{name} tok/s", f"{name} tok/s"))
        if LLAMA in systems and name != LLAMA:
            columns.append((f"{name} x", f"{name} / llama-server"))
    table = markdown_table(rows, columns)
    print(table)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    payload = {"command": "python -m scripts.bench prefill", "args": vars(args),
               "cpu": cpu_name(), "cpu_flags": flags, "rows": rows,
               "seconds": {f"{n}|{k}": v for (n, k), v in seconds.items()}, "table": table}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run(parser.parse_args())
