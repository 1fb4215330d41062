"""``calls``: how many verify calls per second the verifier's HTTP layer serves, and its CPU cost
per call (issue #13's "the HTTP layer keeps up").

A tiny target (a forward costs well under a millisecond) makes the model nearly free, so what is
measured is everything around it: HTTP parsing, validation, JSON, the scheduler and the jobs.
Clients are separate processes, each one asyncio loop with many sessions over keep-alive
connections, so the client side is not what limits the rate (check the table's client CPU).
For every concurrency: calls/s, the verifier's CPU microseconds per call (from /proc: every
thread of its process), the share of that spent on the model thread (forward + acceptance) and
the mean batch size.

  python -m scripts.bench calls                        # about a minute
  python -m scripts.bench calls --sessions 1 16 64 --seconds 10 --k 4
  python -m scripts.bench calls --target PATH --device cuda    # a real target on a GPU
  python -m scripts.bench calls --baseline /tmp/base --rounds 2   # against another checkout
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from scripts.bench.call_client import client_process
from scripts.bench.common import machine_record, markdown_table, write_json
from tests.support.tiny_models import build_tokenizer
from verifier_service.launch import VerifierProcess

TICKS = os.sysconf("SC_CLK_TCK")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="a real target (folder); default: a tiny random Qwen2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 64],
                        help="concurrent sessions (spread over the client processes)")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="drafts per verify call")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time per row")
    parser.add_argument("--threads", type=int, default=1, help="the verifier's torch threads")
    parser.add_argument("--baseline", default="",
                        help="also measure the verifier of another checkout (its folder, e.g. "
                        "`git worktree add /tmp/base <commit>`), alternating with this one")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds")
    parser.add_argument("--out", default="bench_results/calls.json")


def tiny_target(root: Path) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                         max_position_embeddings=32768, eos_token_id=1, bos_token_id=1,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(root)
    build_tokenizer(config.vocab_size).save_pretrained(root)
    return str(root)


def verifier_flags(target: str, device: str, dtype: str, sessions: int, k: int) -> list[str]:
    """A verifier with room for ``sessions`` sessions of 4096 tokens, all in one batch."""
    return ["--model", target, "--engine", "transformers", "--dtype", dtype, "--device", device,
            "--max-context", "4096",
            "--kv-budget-tokens", str(4096 * (sessions + 4)), "--max-sessions",
            str(sessions + 4), "--max-batch-size", str(sessions), "--max-batch-tokens",
            str(sessions * (k + 1) + 64), "--max-queue", str(4 * sessions + 16),
            "--max-draft-tokens", str(max(k, 1))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def measure(url: str, pid: int, sessions: int, args: argparse.Namespace,
            vocab: int) -> dict[str, Any]:
    procs = min(args.client_processes, sessions)
    shares = [sessions // procs + (1 if i < sessions % procs else 0) for i in range(procs)]
    spawn = multiprocessing.get_context("spawn")
    ready, out, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    workers = [spawn.Process(target=client_process,
                             args=(url, n, args.k, vocab, args.seconds, ready, go, out))
               for n in shares]
    for worker in workers:
        worker.start()
    for _ in workers:  # every client process has started and connected
        ready.get(timeout=300)
    metrics_before = httpx.get(url + "/v1/metrics").json()
    cpu_before, wall_before = cpu_seconds(pid), time.perf_counter()
    go.set()
    results = [out.get(timeout=args.seconds + 120) for _ in workers]
    cpu_after, wall = cpu_seconds(pid), time.perf_counter() - wall_before
    for worker in workers:
        worker.join()
    metrics = httpx.get(url + "/v1/metrics").json()
    calls = sum(c for c, _ in results)
    batches = metrics["batches"] - metrics_before["batches"]
    model_s = (metrics["batches"] * metrics["mean_forward_ms"]
               - metrics_before["batches"] * metrics_before["mean_forward_ms"]) / 1e3
    server_cpu = cpu_after - cpu_before
    return {"sessions": sessions, "calls": calls, "calls_per_s": round(calls / wall, 1),
            "server_cpu_us_per_call": round(1e6 * server_cpu / max(calls, 1), 1),
            "model_thread_us_per_call": round(1e6 * model_s / max(calls, 1), 1),
            "mean_batch": round((metrics["jobs"] - metrics_before["jobs"]) / max(batches, 1), 2),
            "client_cpu_share": round(sum(c for _, c in results) / (wall * len(workers)), 2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = args.target or tiny_target(Path(tempfile.mkdtemp(prefix="specdec-calls-")))
    vocab = int(orjson.loads((Path(target) / "config.json").read_bytes())["vocab_size"])
    flags = verifier_flags(target, args.device, args.dtype, max(args.sessions), args.k)
    systems = [("this checkout", {})]
    if args.baseline:  # another checkout's verifier code, by PYTHONPATH
        systems.insert(0, (f"baseline {args.baseline}", {"PYTHONPATH": args.baseline}))
    rows = []
    for repeat in range(args.rounds):
        for name, env in systems:
            with VerifierProcess(flags, threads=args.threads, env=env) as verifier:
                assert verifier.proc is not None
                for sessions in args.sessions:
                    row = {"system": name, "round": repeat + 1,
                           **measure(verifier.url, verifier.proc.pid, sessions, args, vocab)}
                    print(row, flush=True)
                    rows.append(row)
    table = markdown_table(rows, [
        ("system", "verifier"), ("round", "round"), ("sessions", "sessions"),
        ("calls_per_s", "calls/s"),
        ("server_cpu_us_per_call", "verifier CPU us/call"),
        ("model_thread_us_per_call", "of it model thread us/call"),
        ("mean_batch", "mean batch"), ("client_cpu_share", "client CPU share")])
    print(table)
    payload = {"machine": {**machine_record(argparse.Namespace(
        threads=args.threads, dtype=args.dtype, target=target, drafter="none",
        max_new_tokens=0)), "device": args.device, "k": args.k,
        "client_processes": args.client_processes, "seconds": args.seconds},
        "rows": rows, "table": table}
    write_json(args.out, payload)
    return payload
