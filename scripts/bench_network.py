"""Tokens/s across a real network: client and verifier in two namespaces, added delay 0/20/100 ms.

The verifier (Qwen2.5-Coder 1.5B) runs in one network namespace, the `specdec` CLI in another;
they talk over a veth pair. Delay is added to packets leaving the verifier (tc netem), or, where
the kernel has no netem, by the fault proxy in the verifier's namespace. For each delay: the
target alone (`specdec baseline`) and speculative decoding with each drafter, greedy. Needs root.

  python scripts/bench_network.py --delays 0 20 100 --drafters model ngram --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import netns  # noqa: E402
from scripts.fetch_models import fetch  # noqa: E402
from scripts.verifier_process import write_results  # noqa: E402
from shared.models import OFFLINE_MODELS  # noqa: E402

PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping "
          "intervals given as a list of [start, end] pairs.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--drafters", nargs="+", default=["model", "ngram"])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss in percent")
    parser.add_argument("-k", default="4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/network.json")
    args = parser.parse_args()
    why = netns.available()
    if why is not None:
        raise SystemExit(f"cannot make network namespaces here: {why}")
    for name in {args.target, args.drafter} & set(OFFLINE_MODELS):
        fetch(name, keep_gguf=False)

    rows: list[dict[str, Any]] = []
    with netns.NetPair() as net:
        for delay in args.delays:
            how = net.impair(delay, args.loss)
            procs, url = net.serve(["--model", args.target, "--threads", str(args.threads)],
                                   delay_ms=delay)
            try:
                common = ["--verifier-url", url, "--prompt", PROMPT, "--chat",
                          "--max-new-tokens", str(args.max_new_tokens), "--json"]
                runs = [("target alone", ["baseline", *common])]
                runs += [(f"specdec {d}", ["generate", *common, "-k", args.k, "--drafter",
                                           args.drafter if d == "model" else d,
                                           "--threads", str(args.threads)]
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

    print("\n| added delay | system | tok/s | vs target alone | tokens/call | verify p50 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['delay_ms']:g} ms | {r['system']} | {r['tokens_per_s']:.2f} | "
              f"{r['speedup']:.2f}x | {r['mean_tokens_per_call'] or '-'} | "
              f"{r['verify_p50_ms'] or '-'} |")
    write_results(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
