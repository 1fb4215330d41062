"""Speculative decoding vs the target alone, through one verifier, on the real pair.

For each prompt: the target-only baseline (`/v1/generate`) and speculative decoding with each k,
interleaved in one run, after a warm-up. Prints a Markdown table and writes JSON.

  python scripts/bench.py                       # Qwen2.5-Coder 1.5B target, 0.5B drafter, bf16
  python scripts/bench.py --ks 2 4 6 --max-new-tokens 128 --out bench_results/bench.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_client import SpecDecClient  # noqa: E402
from scripts.fetch_models import fetch  # noqa: E402
from scripts.verifier_process import free_port, start_verifier, stop_verifier, write_results  # noqa: E402

PROMPTS = {
    "code": [
        "Write a Python function `is_prime(n)` that returns True when n is prime.",
        "Write a Python class `LRUCache` with get and put methods, using an OrderedDict.",
    ],
    "english": [
        "Write a short paragraph about why people enjoy walking in the mountains.",
        "Explain to a child, in a few sentences, why the sky is blue.",
    ],
}


def row(workload: str, system: str, k: int | None, runs: list[dict[str, Any]],
        base_tps: float | None) -> dict[str, Any]:
    tps = statistics.median(r["tokens_per_s"] for r in runs)
    return {
        "workload": workload, "system": system, "k": k, "runs": len(runs),
        "new_tokens": sum(r["new_tokens"] for r in runs),
        "tokens_per_s": round(tps, 3),
        "speedup": round(tps / base_tps, 3) if base_tps else 1.0,
        "acceptance_rate": round(statistics.mean(r["acceptance_rate"] for r in runs), 3)
        if k else None,
        "mean_tokens_per_call": round(statistics.mean(r["mean_tokens_per_call"] for r in runs), 3)
        if k else None,
        "bytes_per_token": round(statistics.mean(r["bytes_per_token"] for r in runs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--verifier-url", help="use a running verifier instead of starting one")
    parser.add_argument("--out", default="bench_results/bench.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    proc = None
    url = args.verifier_url
    if url is None:
        for name in {args.target, args.drafter}:
            fetch(name, keep_gguf=False)
        port = free_port()
        proc = start_verifier(args.target, port, args.threads)
        url = f"http://127.0.0.1:{port}"
    try:
        client = SpecDecClient(url, args.drafter)
        client.generate("def f():", max_new_tokens=8)  # warm both sides
        rows = []
        for workload, prompts in PROMPTS.items():
            results: dict[Any, list[dict[str, Any]]] = {"baseline": []}
            for prompt in prompts:  # systems interleaved per prompt
                base = client.baseline(prompt, chat=True, max_new_tokens=args.max_new_tokens)
                results["baseline"].append(base.metrics.to_dict())
                print(f"[{workload}] baseline {base.metrics.to_dict()['tokens_per_s']:.2f} tok/s",
                      flush=True)
                for k in args.ks:
                    spec = client.generate(prompt, chat=True, num_draft_tokens=k,
                                           max_new_tokens=args.max_new_tokens)
                    m = spec.metrics.to_dict()
                    results.setdefault(k, []).append(m)
                    print(f"[{workload}] k={k} {m['tokens_per_s']:.2f} tok/s, acceptance "
                          f"{m['acceptance_rate']:.2f}", flush=True)
            base_tps = statistics.median(r["tokens_per_s"] for r in results["baseline"])
            rows.append(row(workload, "target alone", None, results["baseline"], None))
            for k in args.ks:
                rows.append(row(workload, "specdec (model drafter)", k, results[k], base_tps))
    finally:
        if proc is not None:
            stop_verifier(proc)

    header = ("| workload | system | k | tok/s | speedup | acceptance | tokens/call | B/token |\n"
              "|---|---|---|---|---|---|---|---|")
    print("\n" + header)
    for r in rows:
        print(f"| {r['workload']} | {r['system']} | {r['k'] or '-'} | {r['tokens_per_s']:.2f} | "
              f"{r['speedup']:.2f}x | {r['acceptance_rate'] or '-'} | "
              f"{r['mean_tokens_per_call'] or '-'} | {r['bytes_per_token']} |")
    machine = {"threads": args.threads, "dtype": "bfloat16", "torch": torch.__version__,
               "transformers": transformers.__version__, "python": platform.python_version(),
               "cpu": platform.processor() or platform.machine(),
               "max_new_tokens": args.max_new_tokens, "target": args.target,
               "drafter": args.drafter}
    write_results(args.out, {"machine": machine, "rows": rows})


if __name__ == "__main__":
    main()
