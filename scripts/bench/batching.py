"""``batching``: aggregate throughput of one verifier under N concurrent clients, on vs off.

Each client is a thread with its own SpecDecClient and a model-free n-gram drafter (so the clients
cost almost nothing and the verifier is what is measured), generating greedily on its own prompt
of ``benchmarks/prompts/repeat.json``. For each N the verifier's /v1/metrics give the mean batch
size; outputs must be the same with batching on and off.

  python -m scripts.bench batching --clients 1 2 4 8 16
  python -m scripts.bench batching --target tiny     # a random tiny Llama, seconds
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import torch

from drafter_client import SpecDecClient
from drafter_client.metrics import quantile
from scripts.bench.common import (
    add_base_arguments,
    at_once,
    load_prompts,
    machine_record,
    markdown_table,
    verifier,
    write_json,
)


def run_clients(url: str, prompts: list[str], n: int, max_new_tokens: int,
                k: int) -> dict[str, Any]:
    clients = [SpecDecClient(url, "ngram") for _ in range(n)]
    before = httpx.get(f"{url}/v1/metrics").json()
    results, wall = at_once([
        functools.partial(clients[i].generate, prompts[i % len(prompts)], num_draft_tokens=k,
                          max_new_tokens=max_new_tokens) for i in range(n)])
    after = httpx.get(f"{url}/v1/metrics").json()
    latencies = [s for r in results for s in r.metrics.verify_latencies_s]
    batches = after["batches"] - before["batches"]
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "clients": n, "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3),
        "verify_p50_ms": round(1e3 * quantile(latencies, 0.5), 1),
        "verify_p95_ms": round(1e3 * quantile(latencies, 0.95), 1),
        "mean_batch_size": round((after["jobs"] - before["jobs"]) / max(batches, 1), 2),
        "outputs": [r.token_ids for r in results],
    }


def on_off_sweep(start: Callable[[bool], AbstractContextManager[str]], prompts: list[str],
                 clients: list[int], max_new_tokens: int, k: int
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every client count against a verifier with batching on, then off (``start(batching)``
    yields its URL): (one row per run, one table row per client count comparing the two)."""
    rows: list[dict[str, Any]] = []
    for batching in (True, False):
        with start(batching) as url:
            run_clients(url, prompts, 1, 8, k)  # warm-up
            for n in clients:
                row = {"batching": batching, **run_clients(url, prompts, n, max_new_tokens, k)}
                rows.append(row)
                print(f"batching={'on ' if batching else 'off'} clients={n:2d}: "
                      f"{row['tokens_per_s']:.2f} tok/s, p50 {row['verify_p50_ms']} ms, p95 "
                      f"{row['verify_p95_ms']} ms, mean batch {row['mean_batch_size']}",
                      flush=True)
    table = []
    for n in clients:
        on = next(r for r in rows if r["batching"] and r["clients"] == n)
        off = next(r for r in rows if not r["batching"] and r["clients"] == n)
        table.append({
            "clients": n, "on": on["tokens_per_s"], "off": off["tokens_per_s"],
            "ratio": round(on["tokens_per_s"] / off["tokens_per_s"], 2),
            "p50": f"{on['verify_p50_ms']} / {off['verify_p50_ms']}",
            "p95": f"{on['verify_p95_ms']} / {off['verify_p95_ms']}",
            "batch": on["mean_batch_size"], "equal": on["outputs"] == off["outputs"]})
    print("\n" + markdown_table(table, [
        ("clients", "clients"), ("on", "batching on tok/s"), ("off", "off tok/s"),
        ("ratio", "on/off"), ("p50", "p50 on/off ms"), ("p95", "p95 on/off ms"),
        ("batch", "mean batch on"), ("equal", "outputs equal")]))
    return rows, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, out="bench_results/batching.json", max_new_tokens=32)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=16)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # the clients' own torch work is tiny
    if args.target == "tiny":
        from tests.support.tiny_models import save_tiny

        args.target = str(save_tiny(Path(tempfile.mkdtemp()) / "tiny", "llama", 64, seed=3,
                                    init_range=0.3))
    prompts, _ = load_prompts("repeat")

    def start(batching: bool) -> AbstractContextManager[str]:
        return verifier(args, "--max-batch-size", str(args.max_batch_size),
                        "--batching" if batching else "--no-batching")

    rows, _ = on_off_sweep(start, prompts, args.clients, args.max_new_tokens, args.k)
    payload = {"machine": machine_record(args), "args": vars(args), "rows": rows}
    write_json(args.out, payload)
    return payload
