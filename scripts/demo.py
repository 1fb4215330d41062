"""`make demo`: the Qwen2.5-Coder 1.5B target behind a local verifier, the 0.5B drafter here.

Starts `specdec-verifier` on a free loopback port, runs speculative decoding and the target-only
baseline on one coding prompt, prints both outputs and the speedup, then stops the verifier.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter_client import SpecDecClient  # noqa: E402
from drafter_client.cli import TextStream  # noqa: E402
from scripts.bench.common import fetch_offline_models, load_prompts  # noqa: E402
from tests.support.process import VerifierProcess  # noqa: E402

PROMPT = load_prompts("code-chat")[0][0]  # merge_intervals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    fetch_offline_models(args.target, args.drafter)
    import torch

    torch.set_num_threads(args.threads)
    with VerifierProcess(["--model", args.target], threads=args.threads, quiet=False) as verifier:
        client = SpecDecClient(verifier.url, args.drafter)
        print(f"\n=== speculative: {args.drafter} drafts k={args.num_draft_tokens}, "
              f"{args.target} verifies ===\n", flush=True)
        stream = TextStream(client)
        spec = client.generate(args.prompt, chat=True, num_draft_tokens=args.num_draft_tokens,
                               max_new_tokens=args.max_new_tokens, on_tokens=stream)
        stream.finish()
        print(f"\n\n=== baseline: {args.target} alone (/v1/generate) ===\n", flush=True)
        base = client.baseline(args.prompt, chat=True, max_new_tokens=args.max_new_tokens)
        print(base.text)
        s, b = spec.metrics.to_dict(), base.metrics.to_dict()
        print("\n=== result ===")
        print(f"speculative: {s['new_tokens']} tokens, {s['tokens_per_s']:.2f} tok/s, "
              f"acceptance {s['acceptance_rate']:.2f}, {s['mean_tokens_per_call']:.2f} tokens "
              f"per verify call")
        print(f"baseline:    {b['new_tokens']} tokens, {b['tokens_per_s']:.2f} tok/s")
        print(f"speedup:     {s['tokens_per_s'] / b['tokens_per_s']:.2f}x")
        same = spec.token_ids == base.token_ids
        first_diff = next((i for i, (x, y) in enumerate(zip(spec.token_ids, base.token_ids,
                                                             strict=False)) if x != y), None)
        print("greedy outputs identical: " + ("yes" if same else
              f"no, from token {first_diff} (bf16: a k-token forward and 1-token forwards can "
              "round differently at near-ties)"))


if __name__ == "__main__":
    main()
