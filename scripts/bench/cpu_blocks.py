"""What a forward costs on each CPU engine that verifies exactly, and on llama.cpp's fast one.

One process, the engines on the same model, each through the verifier's engine interface
(``forward`` of the steps a batch holds, every row's logits kept, as a verify block keeps
them): ``w4a8`` (``--engine w4a8``, the default: the GGUF file's own Q4_K / Q6_K weights by one
batch-invariant kernel, exact), ``int8`` (``--engine int8``: int8 weights through fbgemm, rows
quantized alone, exact),
``llama.cpp exact`` (``--engine llama-cpp``, the default kernels) and ``llama.cpp fast``
(``--kernels fast``: whole-batch kernels, not exact), the last two on the Q4_K_M file. For each
session count (every session holding ``--context`` tokens) it times one forward of n new tokens
per session: n = 1 is a one-token step, n = k + 1 a verify block of k drafts. Every round runs
every engine in turn, in rotating order; the table holds medians, each cost also in the
engine's own one-token steps (the speculation that pays: far below n) and per new token.
It also prints the bound of a one-token step: the w4a8 engine's weight bytes over this
machine's read bandwidth (a 2 GB sum on the same threads).

    python -m scripts.bench cpu-blocks --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import markdown_table, write_json
from shared.engines import load_target
from shared.engines.target import BatchForward, ForwardItem
from shared.machine_cache import cpu_name
from verifier_service.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name of the offline pair (its converted folder for int8, "
                        "its GGUF file for llama.cpp)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="cached tokens per session")
    parser.add_argument("--news", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="new tokens per session per forward (k + 1 for k drafts)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["w4a8", "llama.cpp exact",
                                                         "llama.cpp fast"],
                        choices=["w4a8", "w4a8 avx2", "w4a8 portable", "int8", "int8 no outliers",
                                 "llama.cpp exact", "llama.cpp fast"],
                        help="int8 no outliers: --int8-outliers 0 whatever --int8-outliers says; "
                        "w4a8 avx2 / portable: the w4a8 engine on that kernel path (w4a8: the "
                        "best this CPU runs), each path chosen before each of its forwards")
    parser.add_argument("--int8-outliers", type=int, default=0,
                        help="the int8 engine's --int8-outliers (0: the verifier's default)")
    parser.add_argument("--out", default="bench_results/cpu_blocks.json")


def resident() -> int:
    """This process's resident bytes now (VmRSS)."""
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def load(name: str, args: argparse.Namespace) -> tuple[Any, float, int]:
    """The engine, its load time (s) and the resident memory it holds after loading (bytes;
    the load's peak is higher)."""
    before = resident()
    started = time.perf_counter()
    context = args.context + max(args.news) + 1
    settings = Settings(model=args.target, max_context=context,
                        kv_budget_tokens=context * max(args.sessions), threads=args.threads,
                        kernels="fast" if name.endswith("fast") else "exact",
                        int8_outliers=args.int8_outliers if name == "int8" else 0)
    engine = load_target("int8" if name.startswith("int8") else
                         "w4a8" if name.startswith("w4a8") else "llama-cpp",
                         settings.target_options(),
                         settings.engine_options())
    assert isinstance(engine, BatchForward)
    seconds = time.perf_counter() - started
    grown = resident() - before
    return engine, seconds, grown


def use_path(name: str) -> None:
    """The w4a8 kernel path engine ``name`` times (one library serves every w4a8 engine)."""
    if name.startswith("w4a8"):
        from shared.engines.w4a8.build import choose_isa

        choose_isa(name.split(" ", 1)[1] if " " in name else None)


def forward_ms(engine: BatchForward, sessions: int, context: int, new: int) -> float:
    """One forward of ``new`` tokens for each of ``sessions`` slots holding ``context`` tokens
    (every row kept; the next forward writes over them, as over a rejected block)."""
    items = [ForwardItem(slot, context, [(7 * slot + i) % 1000 + 10 for i in range(new)], True)
             for slot in range(sessions)]
    started = time.perf_counter()
    engine.forward(items)
    return (time.perf_counter() - started) * 1000


def read_bandwidth(threads: int, gigabytes: float = 2.0) -> float:
    """Bytes a second this machine reads on ``threads`` threads (the best of 3 sums)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(int(gigabytes * 1e9) // 4)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return gigabytes * 1e9 / best


def run(args: argparse.Namespace) -> dict[str, Any]:
    bandwidth = read_bandwidth(args.threads)
    engines: dict[str, Any] = {}
    loads: dict[str, dict[str, float]] = {}
    for name in args.engines:
        engine, seconds, grown = load(name, args)
        use_path(name)
        for slot in range(max(args.sessions)):  # every session's cache, written once
            assert engine.allocate() == slot
            engine.forward([ForwardItem(slot, 0, [(slot + i) % 1000 + 10
                                                  for i in range(args.context)], False)])
        forward_ms(engine, 1, args.context, 1)  # warm
        engines[name] = engine
        loads[name] = {"load_s": seconds, "resident_mib": grown / 2**20}
        print(f"{name}: loaded in {seconds:.1f} s, holds {grown / 2**20:.0f} MiB resident",
              flush=True)
    times: dict[tuple[str, int, int], list[float]] = {}
    names = list(engines)
    for round_no in range(args.rounds):
        order = names[round_no % len(names):] + names[:round_no % len(names)]
        for sessions in args.sessions:
            for new in args.news:
                for name in order:
                    use_path(name)
                    times.setdefault((name, sessions, new), []).append(
                        forward_ms(engines[name], sessions, args.context, new))
        print(f"round {round_no}: done", flush=True)
    rows = []
    for sessions in args.sessions:
        for new in args.news:
            row: dict[str, Any] = {"sessions": sessions, "new_tokens": new}
            for name in names:
                ms = statistics.median(times[(name, sessions, new)])
                step = statistics.median(times[(name, 1, 1)]) if 1 in args.sessions \
                    and 1 in args.news else None
                row[f"{name} ms"] = ms
                row[f"{name} steps"] = ms / step if step else None
                row[f"{name} ms/token"] = ms / (sessions * new)
            rows.append(row)
    columns = [("sessions", "sessions"), ("new_tokens", "new tokens each")]
    for name in names:
        columns += [(f"{name} ms", f"{name} ms"),
                    (f"{name} steps", f"{name}, in its one-token steps"),
                    (f"{name} ms/token", f"{name} ms a token")]
    table = markdown_table(rows, columns)
    print(table)
    bound = None
    if "w4a8" in engines:
        weights = engines["w4a8"].decoder.weight_bytes
        bound = {"weight_bytes": weights, "read_gb_s": bandwidth / 1e9,
                 "step_bound_ms": weights / bandwidth * 1000}
        print(f"bound of a one-token step: {weights / 1e9:.2f} GB of weights at "
              f"{bandwidth / 1e9:.1f} GB/s = {bound['step_bound_ms']:.1f} ms")
    payload = {"command": args.command_line if hasattr(args, "command_line") else
               "python -m scripts.bench cpu-blocks", "args": {k: v for k, v in vars(args).items()
                                                              if k != "command_line"},
               "cpus": os.cpu_count(), "cpu": cpu_name(), "engines": loads, "rows": rows,
               "bound": bound,
               "times_ms": {f"{n}|{s}|{k}": v for (n, s, k), v in times.items()},
               "table": table}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run(parser.parse_args())
