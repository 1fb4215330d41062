"""Tokens/s across a real network: client and verifier in two namespaces, added delay 0/20/100 ms.

The verifier (Qwen2.5-Coder 1.5B) runs in one network namespace, the `specdec` CLI in another;
they talk over a veth pair. Delay is added to packets leaving the verifier (tc netem), or, where
the kernel has no netem, by the fault proxy in the verifier's namespace. For each delay: the
target alone (`specdec baseline`) and speculative decoding with each drafter, greedy. Needs root.

  python -m scripts.bench network --delays 0 20 100 --drafters model ngram --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import subprocess
from typing import Any

import orjson

from scripts.bench.common import (
    add_base_arguments,
    fetch_offline_models,
    load_prompts,
    machine_record,
    markdown_table,
    write_json,
)
from tests.support import netns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, out="bench_results/network.json")
    parser.add_argument("--drafters", nargs="+", default=["model", "ngram"])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss in percent")
    parser.add_argument("-k", default="4")


def run(args: argparse.Namespace) -> dict[str, Any]:
    why = netns.available()
    if why is not None:
        raise SystemExit(f"cannot make network namespaces here: {why}")
    fetch_offline_models(args.target, args.drafter)
    prompt = load_prompts("code-chat")[0][0]  # merge_intervals

    rows: list[dict[str, Any]] = []
    with netns.NetPair() as net:
        for delay in args.delays:
            how = net.impair(delay, args.loss)
            procs, url = net.serve(["--model", args.target, "--threads", str(args.threads),
                                    "--dtype", args.dtype, "--engine", args.engine],
                                   delay_ms=delay)
            try:
                common = ["--verifier-url", url, "--prompt", prompt, "--chat",
                          "--max-new-tokens", str(args.max_new_tokens), "--json"]
                runs = [("target alone", ["baseline", *common])]
                runs += [(f"specdec {d}", ["generate", *common, "-k", args.k, "--drafter",
                                           args.drafter if d == "model" else d,
                                           "--threads", str(args.threads),
                                           "--drafter-engine", args.engine]
                          + (["--tokenizer", args.drafter] if d != "model" else []))
                         for d in args.drafters]
                base_tps = None
                for system, cli in runs:
                    run = net.client(cli)
                    if run.returncode != 0:
                        raise SystemExit(f"{system} at {delay:g} ms failed: {run.stderr}")
                    m = orjson.loads(run.stdout)["metrics"]
                    base_tps = base_tps or m["tokens_per_s"]
                    rows.append({
                        "delay_ms": delay, "loss_pct": args.loss, "impairment": how,
                        "system": system, "tokens_per_s": m["tokens_per_s"],
                        "speedup": round(m["tokens_per_s"] / base_tps, 3),
                        "mean_tokens_per_call": m["mean_tokens_per_call"]
                        if m["verify_calls"] else None,
                        "verify_p50_ms": m["verify_latency_ms"]["p50"]
                        if m["verify_calls"] else None,
                        "retries": m.get("retries", 0),
                    })
                    print(f"delay {delay:g} ms ({how}): {system} {m['tokens_per_s']:.2f} tok/s",
                          flush=True)
            finally:
                netns.stop(procs)
                subprocess.run([*net.exec_prefix("srv"), "tc", "qdisc", "del", "dev",
                                net.srv_dev, "root"], capture_output=True, check=False)
                subprocess.run([*net.exec_prefix("srv"), "nft", "flush", "ruleset"],
                               capture_output=True, check=False)

    print("\n" + markdown_table(rows, [
        ("delay_ms", "added delay ms"), ("system", "system"), ("tokens_per_s", "tok/s"),
        ("speedup", "vs target alone"), ("mean_tokens_per_call", "tokens/call"),
        ("verify_p50_ms", "verify p50 ms")]))
    payload = {"machine": machine_record(args), "args": vars(args), "rows": rows}
    write_json(args.out, payload)
    return payload
