"""Predicted Outputs: an edit of a code file, with the file as the prediction.

The chat asks for a one-name change in a code file and the whole file back; the prediction is
the file as it is. Systems, run one after another in alternating order, each round: on the same
verifier, the target alone (plain steps through a session, no drafts), speculation with the
client's drafter (``-k auto``) and speculation with the prediction too; with ``--engine
llama-cpp`` or ``w4a8`` also ``llama-server`` on the same GGUF files (its target alone, its
draft model, its n-gram drafting over the prompt, which holds the file: it has no prediction
field). Reported:
tokens, seconds, tokens per second, speedup over our target alone (whole, and after the first
block - for llama-server after its prompt - since writing the long prompt dominates), whether
the tokens equal our target alone's (greedy), and the prediction tokens the target accepted and
rejected. ``--max-new-tokens`` caps the answer (the edit sits near the file's top, so the capped
answer holds it).

    python -m scripts.bench prediction --engine llama-cpp --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafter_client.api import SpecDecClient
from drafter_client.prediction import PredictionCounts
from scripts.bench.common import (
    add_base_arguments,
    machine_record,
    markdown_table,
    verifier,
    write_json,
)

ROOT = Path(__file__).resolve().parents[2]
GGUF_ENGINES = ("llama-cpp", "w4a8")  # engines of GGUF targets (the drafter on llama.cpp too)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, "bench_results/prediction.json", max_new_tokens=256,
                       engines=("transformers", *GGUF_ENGINES))
    parser.add_argument("--file", default=str(ROOT / "shared" / "http" / "cross_site.py"),
                        help="the file to edit (150-300 lines)")
    parser.add_argument("--rename", nargs=2, default=["split_host", "host_and_port"],
                        metavar=("OLD", "NEW"), help="the name to change, and to what")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-llama-server", action="store_true",
                        help="leave llama-server out (it runs with the GGUF engines only)")


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    after_s: float  # after the first block came back (llama-server: after its prompt)
    prediction: PredictionCounts | None = None


def ours(client: SpecDecClient, prompt: list[int], max_new: int,
         **kwargs: Any) -> Callable[[], Run]:
    def go() -> Run:
        first: list[float] = []  # when the first block (the prompt's write) came back
        started = time.perf_counter()
        result = client.generate(
            prompt, max_new_tokens=max_new, temperature=0,
            on_tokens=lambda ids: first.append(time.perf_counter()) if not first else None,
            **kwargs)
        total = time.perf_counter() - started
        return Run(result.token_ids, total, total - (first[0] - started), result.prediction)
    return go


def peer(server: Any, prompt: list[int], max_new: int) -> Callable[[], Run]:
    def go() -> Run:
        reply = server.generate(prompt, max_new)
        return Run(reply["tokens"], reply["wall_s"], reply["wall_s"] - reply["prompt_s"])
    return go


def llama_servers(args: argparse.Namespace) -> dict[str, Any]:
    """llama-server's systems on the same GGUF files (started here; the caller closes them)."""
    from scripts.bench.llama import LlamaServer, gguf_of, llama_server_binary, peer_modes

    binary, target = llama_server_binary(), gguf_of(args.target)
    servers: dict[str, Any] = {}
    try:
        for name, extra in peer_modes(gguf_of(args.drafter), args.threads).items():
            servers[name] = LlamaServer(binary, target, args.threads, extra)
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = Path(args.file).read_text()
    old, new = args.rename
    ask = (f"Rename the function `{old}` to `{new}` in this file, everywhere it is used. Reply "
           f"with the whole file and nothing else.\n\n```python\n{source}```")
    gguf = args.engine in GGUF_ENGINES  # llama-server runs the same files
    servers = llama_servers(args) if gguf and not args.no_llama_server else {}
    try:
        with verifier(args, "--max-new-tokens", str(max(args.max_new_tokens, 256))) as url:
            client = SpecDecClient(url, args.drafter,
                                   options=_llama_options() if gguf else None)
            prompt = client.encode_chat([{"role": "user", "content": ask}])
            n = args.max_new_tokens
            systems = {
                "target alone": ours(client, prompt, n, num_draft_tokens=0),
                "speculative": ours(client, prompt, n, num_draft_tokens="auto"),
                "speculative + prediction": ours(client, prompt, n, num_draft_tokens="auto",
                                                 prediction=f"```python\n{source}```"),
                **{name: peer(server, prompt, n) for name, server in servers.items()},
            }
            runs: dict[str, list[Run]] = {name: [] for name in systems}
            client.generate(prompt[:32], max_new_tokens=4, temperature=0)  # warm up
            for server in servers.values():
                server.generate(prompt[:32], 4)
            for round_ in range(args.rounds):
                order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
                for name in order:
                    runs[name].append(systems[name]())
    finally:
        for server in servers.values():
            server.close()
    rows = table(runs)
    print(markdown_table(rows, [("system", "system"), ("tokens", "tokens"),
                                ("seconds", "s (best)"), ("tokens_per_s", "tok/s"),
                                ("speedup", "speedup"),
                                ("after_first_block_s", "s after 1st block / prompt"),
                                ("decode_speedup", "speedup after it"),
                                ("equal_to_target_alone", "exact"),
                                ("accepted_prediction_tokens", "pred. accepted"),
                                ("rejected_prediction_tokens", "pred. rejected")]))
    payload = {"command": args.command_line, "machine": machine_record(args),
               "engine": args.engine, "file": Path(args.file).name,
               "file_lines": source.count("\n"), "prompt_tokens": len(prompt), "rows": rows,
               "peer": "llama-server on the same GGUF files (no prediction field: its "
                       "ngram-simple mode drafts from the prompt, which holds the file)"
                       if servers else "llama-server not measured"}
    write_json(args.out, payload)
    return payload


def table(runs: dict[str, list[Run]]) -> list[dict[str, Any]]:
    """One row per system: its best round, against our target alone's best."""
    reference = runs["target alone"][0].tokens
    alone_s = min(r.seconds for r in runs["target alone"])
    alone_after = min(r.after_s for r in runs["target alone"])
    rows = []
    for name, done in runs.items():
        seconds, after = min(r.seconds for r in done), min(r.after_s for r in done)
        counts = done[0].prediction
        rows.append({
            "system": name, "tokens": len(done[0].tokens), "seconds": round(seconds, 2),
            "tokens_per_s": round(len(done[0].tokens) / seconds, 2),
            "speedup": round(alone_s / seconds, 2),
            "after_first_block_s": round(after, 2),
            "decode_speedup": round(alone_after / after, 2),
            "equal_to_target_alone": all(r.tokens == reference for r in done),
            "accepted_prediction_tokens": counts.accepted if counts else None,
            "rejected_prediction_tokens": counts.rejected if counts else None,
        })
    return rows


def _llama_options() -> Any:
    from drafter_client.api import DrafterOptions

    return DrafterOptions(engine="llama-cpp")
