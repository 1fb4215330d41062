"""Where a forward's rows go on the w4a8 engine: each kind of product of the target, every layer's
copy in turn (so the weights stream from memory as a forward's do), at 1-16 rows, and the same
product of one layer again and again (its weights in cache: the kernel's arithmetic alone).

It prints ms for all of a kind's matrices, ms a row, and the in-cache rate in G multiply-adds a
second (a matrix larger than the caches streams either way): what one more row of a block
costs, against what the CPU's integer units could give.
Every round runs every row count; the table holds the best of the rounds.

    python -m scripts.bench w4a8-products --rounds 3
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from scripts.bench.common import markdown_table, write_json
from shared.machine_cache import cpu_flags, cpu_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name whose GGUF file is kept, or a .gguf path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--isa", default=None, help="a kernel path (default: the best here)")
    parser.add_argument("--out", default="bench_results/w4a8_products.json")


def _seconds(decoder: Any, matrices: list[Any], n: int, repeat: int = 1) -> float:
    import torch

    act = decoder.quantize(torch.randn(n, matrices[0].cols))
    out = torch.empty(n, matrices[0].rows)
    started = time.perf_counter()
    for _ in range(repeat):
        for m in matrices:
            decoder.matmul(m, act, n, out)
    return (time.perf_counter() - started) / repeat


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shared.engines.llama_cpp.runtime import resolve_gguf
    from shared.engines.w4a8.build import choose_isa, isa_name
    from shared.engines.w4a8.model import QUANTIZED, GGUFFile, Matrix, W4A8Decoder

    torch.set_num_threads(args.threads)
    choose_isa(args.isa)
    decoder = W4A8Decoder(GGUFFile(resolve_gguf(args.target)[0]), 1, 64)
    kinds: dict[str, list[Matrix]] = {}
    for layer in decoder.layers:
        for name, value in vars(layer).items():
            if isinstance(value, Matrix):
                kinds.setdefault(f"{name} {QUANTIZED[value.type]}", []).append(value)
    kinds[f"head {QUANTIZED[decoder.head.type]}"] = [decoder.head]
    best: dict[tuple[str, int, str], float] = {}
    for round_no in range(args.rounds):
        for kind, matrices in kinds.items():
            for n in args.rows:
                for where, seconds in (
                        ("memory", _seconds(decoder, matrices, n)),
                        ("cache", _seconds(decoder, matrices[:1], n, repeat=20))):
                    key = (kind, n, where)
                    best[key] = min(best.get(key, seconds), seconds)
        print(f"round {round_no}: done", flush=True)
    rows = []
    for kind, matrices in kinds.items():
        m = matrices[0]
        for n in args.rows:
            memory, cache = best[(kind, n, "memory")], best[(kind, n, "cache")]
            rows.append({"product": kind, "matrices": len(matrices), "shape": f"{m.rows}x{m.cols}",
                         "rows": n, "ms": 1000 * memory, "ms a row": 1000 * memory / n,
                         "in cache G mul-adds/s": n * m.rows * m.cols / cache / 1e9})
    table = markdown_table(rows, [(k, k) for k in rows[0]])
    print(f"w4a8 products on the {isa_name()} path, {args.threads} threads:")
    print(table)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    payload = {"command": "python -m scripts.bench w4a8-products", "args": vars(args),
               "isa": isa_name(), "cpu": cpu_name(), "cpu_flags": flags, "rows": rows,
               "table": table}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run it as python -m scripts.bench w4a8-products")
