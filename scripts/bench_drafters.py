"""Drafters x draft length x workload x simulated round trip, against the target alone.

One verifier (Qwen2.5-Coder 1.5B, bf16), one client process; for every workload and simulated RTT
the baseline and every (drafter, k) run on the same prompt, interleaved, greedy. Prints a Markdown
table per RTT and writes JSON.

  python scripts/bench_drafters.py --max-new-tokens 64 --rtts 0 20 100 \
      --drafters model ngram prompt-lookup bigram --ks 2 4 8 auto
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_client import SpecDecClient  # noqa: E402
from scripts.fetch_models import fetch  # noqa: E402
from scripts.verifier_process import free_port, start_verifier, stop_verifier, write_results  # noqa: E402

ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents "
    "said the lanes made the street safer for children walking to school, but several shop "
    "owners said that removing parking spaces had reduced the number of customers. The council "
    "agreed to count visitors for three months and to decide in the spring whether to keep the "
    "lanes, move them to a parallel street, or restore the parking spaces."
)
WORKLOADS = {
    "code": "Write a Python function `flatten(nested)` that flattens an arbitrarily nested list.",
    "english": "Write a short paragraph about why people enjoy walking in the mountains.",
    "input-grounded": "Rewrite the following text in the first person plural, as if the "
                      f"council wrote it, keeping every detail:\n\n{ARTICLE}",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--model-drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--drafters", nargs="+",
                        default=["model", "ngram", "prompt-lookup", "bigram"])
    parser.add_argument("--ks", nargs="+", default=["2", "4", "8", "auto"])
    parser.add_argument("--rtts", type=float, nargs="+", default=[0.0, 20.0, 100.0],
                        help="simulated round-trip times in ms")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/drafters.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    for name in {args.target, args.model_drafter}:
        fetch(name, keep_gguf=False)
    port = free_port()
    proc = start_verifier(args.target, port, args.threads)
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        clients = {d: SpecDecClient(url, args.model_drafter if d == "model" else d)
                   for d in args.drafters}
        baseline_client = next(iter(clients.values()))
        baseline_client.generate("def f():", max_new_tokens=8)  # warm both sides
        for rtt in args.rtts:
            for workload in args.workloads:
                prompt = WORKLOADS[workload]
                baseline_client.verifier.simulated_rtt_s = rtt / 1e3
                base = baseline_client.baseline(prompt, chat=True,
                                                max_new_tokens=args.max_new_tokens)
                base_tps = base.metrics.to_dict()["tokens_per_s"]
                rows.append({"rtt_ms": rtt, "workload": workload, "drafter": "target alone",
                             "k": "-", "tokens_per_s": base_tps, "speedup": 1.0})
                print(f"rtt {rtt:g} ms, {workload}: baseline {base_tps:.2f} tok/s", flush=True)
                for drafter, client in clients.items():
                    client.verifier.simulated_rtt_s = rtt / 1e3
                    for k in args.ks:
                        started = time.perf_counter()
                        spec = client.generate(prompt, chat=True, num_draft_tokens=k,
                                               max_new_tokens=args.max_new_tokens)
                        m = spec.metrics.to_dict()
                        rows.append({
                            "rtt_ms": rtt, "workload": workload, "drafter": drafter, "k": k,
                            "tokens_per_s": m["tokens_per_s"],
                            "speedup": round(m["tokens_per_s"] / base_tps, 3),
                            "acceptance_rate": m["acceptance_rate"],
                            "mean_tokens_per_call": m["mean_tokens_per_call"],
                            "same_as_baseline": spec.token_ids == base.token_ids,
                            "wall_s": round(time.perf_counter() - started, 2),
                        })
                        print(f"  {drafter} k={k}: {m['tokens_per_s']:.2f} tok/s "
                              f"({rows[-1]['speedup']:.2f}x), acceptance "
                              f"{m['acceptance_rate']:.2f}, {m['mean_tokens_per_call']:.2f} "
                              "tokens/call", flush=True)
    finally:
        stop_verifier(proc)

    for rtt in args.rtts:
        print(f"\n### simulated RTT {rtt:g} ms\n")
        print("| workload | drafter | k | tok/s | speedup | acceptance | tokens/call |")
        print("|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["rtt_ms"] == rtt):
            print(f"| {r['workload']} | {r['drafter']} | {r['k']} | {r['tokens_per_s']:.2f} | "
                  f"{r['speedup']:.2f}x | {r.get('acceptance_rate', '-')} | "
                  f"{r.get('mean_tokens_per_call', '-')} |")
    write_results(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
