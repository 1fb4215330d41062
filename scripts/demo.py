"""`make demo`: the Qwen2.5-Coder 1.5B target behind a local verifier, the 0.5B drafter here.

Starts `specdec-verifier` on a free loopback port with its defaults, builds the client with the
project's defaults (engine `auto`: llama.cpp on the kept GGUF files on a CPU where it is
installed, else transformers with dtype `auto`: float32 on a CPU; the model drafter
hybrid with prompt lookup, `-k auto`) and says what they chose. Then, for two short tasks - a
code question and an input-grounded edit of a given snippet - it streams the speculative answer,
runs the target alone on the same verifier (`/v1/generate`, the same engine and dtype) and
prints one line `speedup: X.XXx` and whether the greedy outputs match. The speedup is the median
of ``--rounds`` side-by-side pairs whose order alternates (target alone first, then the
speculative run first, ...): one pair on a shared 2-core machine moves by 10% from run to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter_client import GenerationResult, SpecDecClient  # noqa: E402
from drafter_client.apps.output import TextStream  # noqa: E402
from drafter_client.settings import DEFAULTS  # noqa: E402
from shared.engines import resolve  # noqa: E402
from shared.models.fetch import fetch_offline_models  # noqa: E402
from verifier_service.launch import VerifierProcess  # noqa: E402

SNIPPET = '''def load_scores(path):
    scores = {}
    with open(path) as handle:
        for line in handle:
            name, value = line.strip().split(",")
            scores[name] = int(value)
    return scores
'''

TASKS = [
    ("code question", "Write a Python function `is_balanced(text)` that returns True when the "
     "brackets (), [] and {} in the string are balanced. Keep it short."),
    ("input-grounded edit", "Add type hints and a one-line docstring to this function. Change "
     "nothing else and return the whole function:\n\n" + SNIPPET),
]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def summary(pairs: list[tuple[GenerationResult, GenerationResult]]) -> str:
    """Print each side-by-side pair; the result line: the median speedup and the greedy check."""
    speedups, differs = [], None
    for spec, base in pairs:
        s, b = spec.metrics.to_dict(), base.metrics.to_dict()
        speedups.append(s["tokens_per_s"] / b["tokens_per_s"])
        print(f"--- {s['new_tokens']} tokens: speculative {s['tokens_per_s']:.2f} tok/s "
              f"(acceptance {s['acceptance_rate']:.2f}, {s['verify_calls']} verify calls), "
              f"target alone {b['tokens_per_s']:.2f} tok/s: {speedups[-1]:.2f}x", flush=True)
        differs = differs if differs is not None else first_difference(spec.token_ids,
                                                                       base.token_ids)
    same = ("greedy outputs identical" if differs is None else
            f"greedy outputs differ from token {differs} (a block's forward and one-token "
            "forwards can round differently at a near-tie)")
    spread = (f" (median of {len(pairs)} pairs: {min(speedups):.2f}-{max(speedups):.2f}x)"
              if len(pairs) > 1 else "")
    return f"speedup: {statistics.median(speedups):.2f}x{spread}; {same}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("-k", "--num-draft-tokens", default=DEFAULTS.num_draft_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.sampling.max_new_tokens)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=positive, default=3,
                        help="side-by-side pairs per task, in alternating order (median shown)")
    args = parser.parse_args()
    # The client's defaults (drafter_client/settings.py), with the demo's length and threads.
    settings = dataclasses.replace(
        DEFAULTS, num_draft_tokens=str(args.num_draft_tokens),
        sampling=dataclasses.replace(DEFAULTS.sampling, max_new_tokens=args.max_new_tokens),
        options=dataclasses.replace(DEFAULTS.options, threads=args.threads))

    # The GGUF files and tokenizers; bf16 weights only where an engine other than w4a8 or
    # llama.cpp runs a side (transformers loads the converted folder).
    fetch_offline_models(args.target, args.drafter, convert=False)
    if (resolve("auto", args.target).name not in ("w4a8", "llama-cpp")
            or resolve(settings.options.engine, args.drafter, drafter=True).name != "llama-cpp"):
        fetch_offline_models(args.target, args.drafter)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the drafter's load: one line of ours says what it chose
    started = time.perf_counter()
    # --engine auto said outright, so a SPECDEC_ENGINE in the environment cannot make the
    # engine printed below differ from the one the verifier runs
    with VerifierProcess(["--model", args.target, "--engine", "auto"],
                         threads=args.threads) as verifier:
        client = SpecDecClient(verifier.url, args.drafter, settings=settings)
        info = client.info
        costs = ", ".join(f"k={k}: {ms:.0f} ms" for k, ms in (info.verify_ms or [])[:4])
        # the engine the verifier runs (/v1/info: auto's choice and why), and the drafter's
        engine = info.engine or resolve("auto", args.target).name
        drafter_engine = resolve(settings.options.engine, args.drafter, drafter=True).name
        weights = {"llama-cpp": "the GGUF file's own weights",
                   "w4a8": "the GGUF file's own weights, batch-invariant kernels",
                   "int8": "int8 weights of the converted folder"}.get(engine, "dtype auto")
        print(f"\nverifier: {args.target}, engine {engine}, {info.dtype} on {info.device} "
              f"({weights}), kernels {info.kernels}; verify forwards {costs}")
        if info.engine_choice:
            print(f"          engine auto: {info.engine_choice}")
        drafter_weights = ("" if drafter_engine == "llama-cpp" else
                           f", dtype chosen: {client.drafter_dtype}")
        print(f"client:   {settings.describe(args.drafter)}; drafter engine chosen: "
              f"{drafter_engine}{drafter_weights} (-k auto: a cost model, k = 0 where drafting "
              "does not pay)")
        print(f"ready in {time.perf_counter() - started:.0f} s", flush=True)
        lines = []
        for name, prompt in TASKS:
            print(f"\n=== {name} ===\n{prompt}\n\n--- speculative ---", flush=True)
            pairs = []
            for round_ in range(args.rounds):
                # the first speculative run streams its text; the order alternates after it
                stream = TextStream(client.decode) if not round_ else None
                if round_ % 2 == 0:
                    spec = client.generate(prompt, chat=True, on_tokens=stream)
                    base = client.baseline(prompt, chat=True)
                else:
                    base = client.baseline(prompt, chat=True)
                    spec = client.generate(prompt, chat=True)
                if stream is not None:
                    stream.finish()
                    print()
                pairs.append((spec, base))
            lines.append(f"{name}: {summary(pairs)}")
        print("\n=== result ===")
        print("\n".join(lines))
    print(f"(demo took {time.perf_counter() - started:.0f} s with the models fetched)")


if __name__ == "__main__":
    main()
