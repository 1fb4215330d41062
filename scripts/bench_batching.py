"""Aggregate throughput of one verifier under N concurrent clients, batching on vs off.

Each client is a thread with its own SpecDecClient and a model-free n-gram drafter (so the clients
cost almost nothing and the verifier is what is measured), generating greedily on its own
input-grounded prompt. For each N the verifier's /v1/metrics give the mean batch size.

  python scripts/bench_batching.py --target qwen2.5-coder-1.5b --clients 1 2 4 8 16
  python scripts/bench_batching.py --target tiny     # a random tiny Llama, seconds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_client import SpecDecClient  # noqa: E402
from drafter_client.metrics import quantile  # noqa: E402
from scripts.verifier_process import free_port, start_verifier, stop_verifier, write_results  # noqa: E402

TEXTS = [
    "The river rose after three days of rain and the bridge was closed to traffic.",
    "Our team shipped the new billing page, fixed two bugs in the export and wrote docs.",
    "The museum opens at nine, closes at five, and is free on the first Sunday of the month.",
    "She planted tomatoes, basil and peppers in April and harvested them in late August.",
]


def prompt_for(i: int) -> str:
    text = " ".join(TEXTS[(i + j) % len(TEXTS)] for j in range(3))
    return f"Repeat the following text exactly, then stop.\n\n{text}\n\nRepeated text:\n{text[:40]}"


def tiny_target(folder: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import save_tiny  # the test fixture's tiny Llama

    return str(save_tiny(folder / "tiny", "llama", 64, seed=3, init_range=0.3))


def run_clients(url: str, n: int, max_new_tokens: int, k: int) -> dict[str, Any]:
    clients = [SpecDecClient(url, "ngram") for _ in range(n)]
    before = httpx.get(f"{url}/v1/metrics").json()
    results: list[Any] = [None] * n

    def work(i: int) -> None:
        results[i] = clients[i].generate(prompt_for(i), num_draft_tokens=k,
                                         max_new_tokens=max_new_tokens)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    after = httpx.get(f"{url}/v1/metrics").json()
    latencies = [s for r in results for s in r.metrics.verify_latencies_s]
    batches = after["batches"] - before["batches"]
    return {
        "clients": n, "tokens": sum(len(r.token_ids) for r in results),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(len(r.token_ids) for r in results) / wall, 3),
        "verify_p50_ms": round(1e3 * quantile(latencies, 0.5), 1),
        "verify_p95_ms": round(1e3 * quantile(latencies, 0.95), 1),
        "mean_batch_size": round((after["jobs"] - before["jobs"]) / max(batches, 1), 2),
        "outputs": [r.token_ids for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="model spec or 'tiny'")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/batching.json")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the clients' own torch work is tiny
    target = tiny_target(Path(tempfile.mkdtemp())) if args.target == "tiny" else args.target
    rows: list[dict[str, Any]] = []
    for batching in (True, False):
        port = free_port()
        extra = ("--max-batch-size", "16") + (() if batching else ("--no-batching",))
        proc = start_verifier(target, port, args.threads, extra, quiet=True)
        try:
            url = f"http://127.0.0.1:{port}"
            run_clients(url, 1, 8, args.k)  # warm-up
            for n in args.clients:
                row = {"batching": batching, **run_clients(url, n, args.max_new_tokens, args.k)}
                rows.append(row)
                print(f"batching={'on ' if batching else 'off'} clients={n:2d}: "
                      f"{row['tokens_per_s']:.2f} tok/s, p50 {row['verify_p50_ms']} ms, p95 "
                      f"{row['verify_p95_ms']} ms, mean batch {row['mean_batch_size']}",
                      flush=True)
        finally:
            stop_verifier(proc)

    print("\n| clients | batching on tok/s | off tok/s | on/off | p50 on/off ms | p95 on/off ms "
          "| mean batch on | outputs equal |\n|---|---|---|---|---|---|---|---|")
    for n in args.clients:
        on = next(r for r in rows if r["batching"] and r["clients"] == n)
        off = next(r for r in rows if not r["batching"] and r["clients"] == n)
        print(f"| {n} | {on['tokens_per_s']:.2f} | {off['tokens_per_s']:.2f} | "
              f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x | {on['verify_p50_ms']} / "
              f"{off['verify_p50_ms']} | {on['verify_p95_ms']} / {off['verify_p95_ms']} | "
              f"{on['mean_batch_size']} | {on['outputs'] == off['outputs']} |")
    write_results(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
