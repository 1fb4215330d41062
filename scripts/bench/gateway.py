"""The OpenAI gateway's cost: the same generations through ``specdec serve`` (the official
``openai`` client, streamed and not) and through the Python client directly, side by side.

  python -m scripts.bench gateway                       # the Qwen pair, model drafter, greedy
  python -m scripts.bench gateway --drafter-kind ngram --concurrency 1 4

One verifier process; the gateway runs in this process (a uvicorn thread) with the same drafter.
Rows: tok/s per method at each concurrency (requests in flight at once, each its own session),
and the gateway's tok/s as a ratio of the direct client's, measured in the same run, with the
methods interleaved per prompt.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from drafter_client import ClientSettings, SpecDecClient
from drafter_client.gateway import GatewaySettings, create_gateway
from drafter_client.settings import DrafterOptions
from scripts.bench.common import (
    add_base_arguments,
    load_prompts,
    machine_record,
    markdown_table,
    verifier,
    write_json,
)
from tests.support.servers import ThreadedServer

NAME = "bench-model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, out="bench_results/gateway.json", max_new_tokens=48)
    parser.add_argument("--drafter-kind", choices=["model", "ngram", "prompt-lookup"],
                        default="model")
    parser.add_argument("-k", default="4")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompts", type=int, default=4, help="prompts (english workload)")


def _direct(client: SpecDecClient, prompt: str, max_new: int, k: str) -> int:
    return len(client.fork().generate(prompt, num_draft_tokens=k, max_new_tokens=max_new,
                                      chat=True).token_ids)


def _gateway(oai: Any, prompt: str, max_new: int, stream: bool) -> int:
    messages: Any = [{"role": "user", "content": prompt}]
    if not stream:
        reply = oai.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                            max_tokens=max_new)
        return reply.usage.completion_tokens if reply.usage else 0
    tokens = 0
    for chunk in oai.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                             max_tokens=max_new, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def _burst(fn: Any, prompts: list[str], concurrency: int) -> tuple[int, float]:
    """Every prompt once, ``concurrency`` at a time: (tokens, wall seconds)."""
    tokens, lock = 0, threading.Lock()
    queue = list(prompts)

    def worker() -> None:
        nonlocal tokens
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            made = fn(prompt)
            with lock:
                tokens += made

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    prompts = load_prompts("english")[0][: args.prompts]
    rows: list[dict[str, Any]] = []
    with verifier(args) as url:
        drafter = args.drafter if args.drafter_kind == "model" else args.drafter_kind
        client = SpecDecClient(url, drafter, None if args.drafter_kind == "model"
                               else args.drafter,
                               settings=ClientSettings(
                                   num_draft_tokens=str(args.k), dtype=args.dtype,
                                   options=DrafterOptions(engine=args.engine)))
        settings = GatewaySettings(NAME, max_concurrency=max(args.concurrency))
        import openai  # here, not at import: `python -m scripts.bench` runs without it (GPU box)

        with ThreadedServer(create_gateway(client, settings)) as gateway:
            oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
            methods = {
                "direct client": lambda p: _direct(client, p, args.max_new_tokens, args.k),
                "gateway": lambda p: _gateway(oai, p, args.max_new_tokens, False),
                "gateway, streamed": lambda p: _gateway(oai, p, args.max_new_tokens, True),
            }
            for fn in methods.values():  # warm every path once
                fn(prompts[0])
            for concurrency in args.concurrency:
                results: dict[str, list[float]] = {m: [] for m in methods}
                for _ in range(2):  # two rounds, methods interleaved
                    for name, fn in methods.items():
                        tokens, wall = _burst(fn, prompts, concurrency)
                        results[name].append(tokens / wall)
                direct = statistics.median(results["direct client"])
                for name, values in results.items():
                    tps = statistics.median(values)
                    rows.append({"concurrency": concurrency, "method": name,
                                 "tokens_per_s": round(tps, 3),
                                 "vs_direct": round(tps / direct, 3)})
    print(markdown_table(rows, [("concurrency", "concurrent requests"), ("method", "method"),
                                ("tokens_per_s", "tok/s"), ("vs_direct", "vs direct")]))
    payload = {"machine": {**machine_record(args), "drafter_kind": args.drafter_kind,
                           "k": args.k, "prompts": len(prompts)},
               "command": args.command_line, "rows": rows}
    write_json(args.out, payload)
    return payload
