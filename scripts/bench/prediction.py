"""Predicted Outputs: an edit of a code file, with the file as the prediction.

The chat asks for a one-name change in a code file and the whole file back; the prediction is
the file as it is. Systems, run one after another in alternating order, each round on the same
verifier: the target alone (plain steps through a session, no drafts), speculation with the
client's drafter (``-k auto``), and speculation with the prediction too. Reported: tokens,
seconds, tokens per second, speedup over the target alone (whole, and after the first block,
whose round trip writes the long prompt), whether the tokens equal the target
alone's (greedy), and the prediction tokens the target accepted and rejected. ``--max-new-tokens``
caps the answer (the edit sits near the file's top, so the capped answer holds it).

    python -m scripts.bench prediction --engine llama-cpp --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from drafter_client.api import SpecDecClient
from scripts.bench.common import (
    add_base_arguments,
    machine_record,
    markdown_table,
    verifier,
    write_json,
)

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, "bench_results/prediction.json", max_new_tokens=256)
    parser.add_argument("--file", default=str(ROOT / "shared" / "http" / "cross_site.py"),
                        help="the file to edit (150-300 lines)")
    parser.add_argument("--rename", nargs=2, default=["split_host", "host_and_port"],
                        metavar=("OLD", "NEW"), help="the name to change, and to what")
    parser.add_argument("--rounds", type=int, default=2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = Path(args.file).read_text()
    old, new = args.rename
    ask = (f"Rename the function `{old}` to `{new}` in this file, everywhere it is used. Reply "
           f"with the whole file and nothing else.\n\n```python\n{source}```")
    with verifier(args, "--max-new-tokens", str(max(args.max_new_tokens, 256))) as url:
        client = SpecDecClient(url, args.drafter,
                               options=None if args.engine != "llama-cpp" else _llama_options())
        prompt = client.encode_chat([{"role": "user", "content": ask}])
        systems: dict[str, dict[str, Any]] = {
            "target alone": {"num_draft_tokens": 0},
            "speculative": {"num_draft_tokens": "auto"},
            "speculative + prediction": {"num_draft_tokens": "auto",
                                         "prediction": f"```python\n{source}```"},
        }
        runs: dict[str, list[Any]] = {name: [] for name in systems}
        client.generate(prompt[:32], max_new_tokens=4, temperature=0)  # warm up
        for round_ in range(args.rounds):
            order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
            for name in order:
                first: list[float] = []  # when the first block (the prompt's write) came back
                started = time.perf_counter()
                result = client.generate(
                    prompt, max_new_tokens=args.max_new_tokens, temperature=0,
                    on_tokens=lambda ids, first=first: first.append(  # type: ignore[misc]
                        time.perf_counter()) if not first else None,
                    **systems[name])
                total = time.perf_counter() - started
                runs[name].append((total, result, total - (first[0] - started)))
    reference = runs["target alone"][0][1].token_ids
    alone_s = min(s for s, _, _ in runs["target alone"])
    alone_after = min(a for _, _, a in runs["target alone"])
    rows = []
    for name, done in runs.items():
        seconds = min(s for s, _, _ in done)
        after = min(a for _, _, a in done)  # after the first block: decoding alone
        result = done[0][1]
        counts = result.prediction
        rows.append({
            "system": name, "tokens": len(result.token_ids), "seconds": round(seconds, 2),
            "tokens_per_s": round(len(result.token_ids) / seconds, 2),
            "speedup": round(alone_s / seconds, 2),
            "after_first_block_s": round(after, 2),
            "decode_speedup": round(alone_after / after, 2),
            "equal_to_target_alone": all(r.token_ids == reference for _, r, _ in done),
            "accepted_prediction_tokens": counts.accepted if counts else None,
            "rejected_prediction_tokens": counts.rejected if counts else None,
        })
    print(markdown_table(rows, [("system", "system"), ("tokens", "tokens"),
                                ("seconds", "s (best)"), ("tokens_per_s", "tok/s"),
                                ("speedup", "speedup"),
                                ("after_first_block_s", "s after 1st block"),
                                ("decode_speedup", "speedup after 1st block"),
                                ("equal_to_target_alone", "exact"),
                                ("accepted_prediction_tokens", "pred. accepted"),
                                ("rejected_prediction_tokens", "pred. rejected")]))
    payload = {"command": args.command_line, "machine": machine_record(args),
               "engine": args.engine, "file": Path(args.file).name,
               "file_lines": source.count("\n"), "prompt_tokens": len(prompt), "rows": rows,
               "peer": "llama-server not measured here (no prediction mode of its own; its "
                       "n-gram drafting is in `python -m scripts.bench llama`)"}
    write_json(args.out, payload)
    return payload


def _llama_options() -> Any:
    from drafter_client.api import DrafterOptions

    return DrafterOptions(engine="llama-cpp")
