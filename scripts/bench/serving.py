"""Many clients on one verifier, next to ``llama-server -np N``'s continuous batching.

For each N in ``--clients`` and each round, every system serves N greedy requests started
together (one thread each, the six prompts - two per workload - cycled, shifted each round), the
systems in an order that rotates every round. Measured per request: output tokens, wall time, time
to first token (prefill) and the decode rate after it; per batch of N: aggregate tok/s (all
output tokens over the span from the first start to the last reply), p50 / p95 request latency,
and fairness (the slowest request's seconds per token over the median request's). specdec's
verifier reports, per batch of N, its scheduler's steps and forward time against the wall
time, and the llama_decode calls it made (``/v1/metrics`` before and after).

Systems (``--systems``):
  llama-server            ``llama-server -np N`` target alone (the peer: continuous batching)
  llama-server-ngram      ``llama-server -np N --spec-type ngram-simple``
  alone                   specdec's target alone (``baseline()``, ``/v1/generate``) x N
  lookup                  specdec prompt lookup, ``-k auto``, x N
  default                 specdec's default client (model drafter + lookup, ``-k auto``) x N:
                          each drafter runs in this process, on the verifier's cores (what a
                          one-machine user gets; across hosts it costs the verifier nothing)
  alone-llama, lookup-llama
                          the same on a second verifier on the llama-cpp engine with its exact
                          kernels (the default before the w4a8 engine)
  alone-fast, lookup-fast the same on a verifier with ``--engine llama-cpp --kernels fast``
                          (llama.cpp's whole-batch kernels, as llama-server's; not exact): what
                          exactness costs under load
  lookup-selfish          prompt lookup whose ``-k auto`` ignores the verifier's load
                          (``ClientSettings(load_aware=False)``): what load-awareness does
  replay-0.5, -0.7, -0.9  clients whose drafter replays the target's recorded answer, each token
                          kept with that probability (``capacity.ReplayDrafter``): drafting on
                          another machine, costing this one nothing (``scripts.bench capacity``)

Every specdec output is checked against specdec's target alone on the same prompt, and each
``llama-server`` mode against ``llama-server``'s target alone (greedy identity under load).

    python -m scripts.bench serving --clients 1 2 4 8 --rounds 3 --max-new-tokens 64
    python -m scripts.bench serving --engine transformers --device cuda --clients 1 8 32 64 \\
        --systems alone lookup default

Prints a table per N, writes the JSON (every request) to ``--out`` and a plot of aggregate tok/s
against N beside it (``.png``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from drafter_client.metrics import quantile
from drafter_client.settings import ClientSettings
from scripts.bench.common import at_once, fetch_offline_models, markdown_table, write_json
from scripts.bench.llama import (
    LlamaServer,
    first_difference,
    gguf_of,
    llama_server_binary,
    prompt_ids,
)
from scripts.bench.suite import workloads
from shared.machine_cache import cpu_name
from shared.models.catalog import OFFLINE_MODELS, load_tokenizer
from verifier_service.launch import VerifierProcess

SYSTEMS = ("llama-server", "llama-server-ngram", "alone", "lookup", "default", "alone-llama",
           "lookup-llama", "alone-fast", "lookup-fast", "lookup-selfish", "replay-0.5",
           "replay-0.7", "replay-0.9")
REPLAY = "replay-"  # clients whose drafting costs nothing here (scripts/bench/capacity.py)
FAST = "-fast"  # on a second verifier: llama.cpp's whole-batch kernels
# the systems on verifiers of their own (suffix -> the engine flags that replace --engine's)
OTHER_VERIFIERS = {"-llama": ["--engine", "llama-cpp"],
                   FAST: ["--engine", "llama-cpp", "--kernels", "fast"]}
PEERS = {"llama-server": [], "llama-server-ngram": ["--spec-type", "ngram-simple"]}
SEQ_TOKENS = 4096  # each session's (each llama-server slot's) context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name of the offline pair, a .gguf file (llama-cpp) or a "
                        "folder (transformers)")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--engine", default="w4a8",
                        choices=["w4a8", "llama-cpp", "transformers", "int8"],
                        help="the verifier's engine, and the default client's drafter's "
                        "(w4a8, int8: its clients draft on llama.cpp)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (transformers engine)")
    parser.add_argument("--dtype", default="auto", help="the verifier's --dtype")
    parser.add_argument("--threads", type=int, default=2,
                        help="the verifier's and llama-server's threads")
    parser.add_argument("--drafter-threads", type=int, default=1,
                        help="each default client's drafter threads")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:9]))
    parser.add_argument("--verifier-arg", action="append", default=[],
                        help="one more flag for the verifier (repeat: --verifier-arg=--x ...)")
    parser.add_argument("--out", default="bench_results/serving.json")


# -- one request per system ---------------------------------------------------------------------
def specdec_request(client: SpecDecClient, ids: list[int], max_new: int,
                    alone: bool) -> dict[str, Any]:
    """One generation: its tokens, wall time, time to its first token (None for the target
    alone, whose ``/v1/generate`` answers once) and what its blocks drafted."""
    first: list[float] = []
    started = time.perf_counter()

    def on_block(_outcome: Any) -> None:
        if not first:
            first.append(time.perf_counter() - started)

    if alone:
        result = client.baseline(ids, max_new_tokens=max_new)
    else:
        result = client.generate(ids, num_draft_tokens="auto", max_new_tokens=max_new,
                                 on_block=on_block)
    wall = time.perf_counter() - started
    m = result.metrics
    return {"tokens": result.token_ids, "wall_s": wall, "ttft_s": first[0] if first else None,
            "drafted": getattr(m, "drafted_tokens", None),
            "accepted": getattr(m, "accepted_tokens", None),
            "verify_calls": getattr(m, "verify_calls", None),
            "draft_lengths": dict(getattr(m, "draft_lengths", {}))}


def peer_request(port: int, ids: list[int], max_new: int) -> dict[str, Any]:
    """One streamed ``/completion`` of ``llama-server``: tokens, wall time, first token."""
    tokens: list[int] = []
    first = None
    timings: dict[str, Any] = {}
    started = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/completion", timeout=600, json={
            "prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "stream": True}) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            new = chunk.get("tokens") or []
            if new and first is None:
                first = time.perf_counter() - started
            tokens += new
            timings = chunk.get("timings", timings)
    wall = time.perf_counter() - started
    return {"tokens": tokens, "wall_s": wall, "ttft_s": first,
            "drafted": timings.get("draft_n"), "accepted": timings.get("draft_n_accepted")}


def verifier_counts(url: str) -> dict[str, float]:
    """The verifier's scheduler and engine counters (``/v1/metrics``)."""
    m = httpx.get(f"{url}/v1/metrics", timeout=30).json()
    llama = {"llama_decodes": m["llama_decodes"]} if "llama_decodes" in m else {}
    return {"steps": m["batches"], "jobs": m["jobs"],
            "forward_s": m["batches"] * m["mean_forward_ms"] / 1e3, **llama,
            "prefill_tokens": m["prefill_tokens"],
            "scored_tokens": m["scored_tokens"], "drafted_tokens": m["drafted_tokens"],
            "accepted_tokens": m["accepted_tokens"]}


# -- the run ------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    llama = args.engine in ("llama-cpp", "w4a8")  # a GGUF file's engines
    target = gguf_of(args.target) if llama else None
    # the w4a8 and int8 verifiers' clients draft on llama.cpp too (the drafter's GGUF file)
    drafter = gguf_of(args.drafter) if args.engine in ("llama-cpp", "int8", "w4a8") else None
    if not llama:
        fetch_offline_models(args.target, args.drafter)
    tokenizer = load_tokenizer(args.target if args.target in OFFLINE_MODELS else str(target))
    prompts = [p for items in workloads(2).values() for p in items]
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    most = max(args.clients)
    peers = [s for s in args.systems if s in PEERS]
    if peers and target is None:
        target = gguf_of(args.target) if args.target in OFFLINE_MODELS else None
    if peers and target is None:
        print("llama-server skipped: no GGUF file of the target")
        peers = []
    ours = [s for s in args.systems if s not in PEERS]
    common = ["--model", str(target) if llama else args.target, "--engine", args.engine,
              "--device", args.device, "--dtype", args.dtype, "--max-context", str(SEQ_TOKENS),
              "--kv-budget-tokens", str(SEQ_TOKENS * most),
              "--max-batch-size", str(max(16, most)), *args.verifier_arg]
    verifier = VerifierProcess(common, threads=args.threads)
    at = common.index("--engine")
    others = {suffix: VerifierProcess(common[:at] + flags + common[at + 2:],
                                      threads=args.threads)
              for suffix, flags in OTHER_VERIFIERS.items()
              if any(s.endswith(suffix) for s in ours)}
    binary = llama_server_binary() if peers else None
    records: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    try:
        verifier.start()
        info = SpecDecClient(verifier.url, None, tokenizer=tokenizer).info
        if any(s.startswith(REPLAY) for s in ours):  # the answers the replay drafters copy
            alone = SpecDecClient(verifier.url, None, tokenizer=tokenizer)
            args.replay_answers = {tuple(i): alone.baseline(
                i, max_new_tokens=args.max_new_tokens).token_ids for i in ids}
            args.replay_vocab = info.vocab_size
        for other in others.values():
            other.start()
        url = {s: next((v.url for suffix, v in others.items() if s.endswith(suffix)),
                       verifier.url) for s in ours}
        for n in args.clients:
            servers = {name: LlamaServer(binary, target, args.threads, PEERS[name],
                                         parallel=n) for name in peers} if binary else {}
            clients = {name: make_clients(base_system(name), n, url[name], tokenizer, drafter,
                                          args) for name in ours}
            try:
                order = [*peers, *ours]
                for round_no in range(args.rounds):
                    shift = round_no % len(order)
                    for system in order[shift:] + order[:shift]:  # alternating order
                        picks = [(j + round_no) % len(prompts) for j in range(n)]
                        before = verifier_counts(url[system]) if system in ours else None
                        if system in servers:
                            calls = [functools.partial(peer_request, servers[system].port,
                                                       ids[p], args.max_new_tokens)
                                     for p in picks]
                        else:
                            calls = [functools.partial(specdec_request, clients[system][j],
                                                       ids[p], args.max_new_tokens,
                                                       system.startswith("alone"))
                                     for j, p in enumerate(picks)]
                        outs, span = at_once(calls)
                        for j, (p, out) in enumerate(zip(picks, outs, strict=True)):
                            records.append({"clients": n, "round": round_no, "system": system,
                                            "client": j, "prompt": prompts[p].name, **out})
                        if before is not None:
                            after = verifier_counts(url[system])
                            steps.append({"clients": n, "round": round_no, "system": system,
                                          "wall_s": span, **{key: after[key] - before[key]
                                                             for key in after}})
                        print(f"N={n} round {round_no} {system}: "
                              f"{sum(len(o['tokens']) for o in outs) / span:.2f} tok/s",
                              flush=True)
            finally:
                for server in servers.values():
                    server.close()
    finally:
        verifier.stop()
        for other in others.values():
            other.stop()
    return report(records, steps, args, info)


def base_system(name: str) -> str:
    """What a system's clients do, whichever verifier serves them (``lookup-llama``: lookup)."""
    for suffix in OTHER_VERIFIERS:
        name = name.removesuffix(suffix)
    return name


def make_clients(system: str, n: int, url: str, tokenizer: Any, drafter: Path | None,
                 args: argparse.Namespace) -> list[SpecDecClient]:
    if system.startswith(REPLAY):
        from scripts.bench.capacity import ReplayDrafter

        rate = float(system.removeprefix(REPLAY))
        return [SpecDecClient(url, ReplayDrafter(args.replay_answers, rate, args.replay_vocab,
                                                 seed=j), tokenizer=tokenizer)
                for j in range(n)]
    if system == "alone":
        return [SpecDecClient(url, None, tokenizer=tokenizer) for _ in range(n)]
    if system in ("lookup", "lookup-selfish"):
        settings = ClientSettings(load_aware=system == "lookup")
        return [SpecDecClient(url, "prompt-lookup", tokenizer=tokenizer, settings=settings)
                for _ in range(n)]
    engine = "llama-cpp" if drafter is not None else "transformers"
    spec = str(drafter) if drafter is not None else args.drafter
    return [SpecDecClient(url, spec, tokenizer=tokenizer, device=args.device,
                          options=DrafterOptions(engine=engine, threads=args.drafter_threads))
            for _ in range(n)]


# -- the report ---------------------------------------------------------------------------------

def report(records: list[dict[str, Any]], steps: list[dict[str, Any]],
           args: argparse.Namespace, info: Any) -> dict[str, Any]:
    alone = {"llama-server": "llama-server", "llama-server-ngram": "llama-server",
             "alone": "alone", "lookup": "alone", "default": "alone",
             "alone-fast": "alone-fast", "lookup-fast": "alone-fast",
             "alone-llama": "alone-llama", "lookup-llama": "alone-llama",
             "lookup-selfish": "alone", **{s: "alone" for s in SYSTEMS if s.startswith(REPLAY)}}
    reference: dict[tuple[str, str], list[int]] = {}
    for r in sorted(records, key=lambda r: r["clients"]):  # each prompt's target-alone output
        if r["system"] in ("llama-server", "alone", "alone-fast", "alone-llama"):  # lightest load
            reference.setdefault((r["system"], r["prompt"]), r["tokens"])
    for r in records:
        want = reference.get((alone[r["system"]], r["prompt"]))
        r["checked"] = want is not None  # the family's target alone ran this prompt
        r["first_difference"] = None if want is None else first_difference(r["tokens"], want)
        r["same_as_alone"] = want is not None and r["tokens"] == want
        r["s_per_token"] = r["wall_s"] / max(len(r["tokens"]), 1)
        if r["ttft_s"] is not None and len(r["tokens"]) > 1:
            r["decode_tok_s"] = (len(r["tokens"]) - 1) / max(r["wall_s"] - r["ttft_s"], 1e-9)
    batches: list[dict[str, Any]] = []
    for key in dict.fromkeys((r["clients"], r["round"], r["system"]) for r in records):
        mine = [r for r in records if (r["clients"], r["round"], r["system"]) == key]
        span = max(r["wall_s"] for r in mine)  # all started together
        per_token = [r["s_per_token"] for r in mine]
        batches.append({"clients": key[0], "round": key[1], "system": key[2],
                        "tok_s": sum(len(r["tokens"]) for r in mine) / span,
                        "fairness": max(per_token) / statistics.median(per_token)})
    rows = []
    for n in args.clients:
        peer = [b["tok_s"] for b in batches
                if b["clients"] == n and b["system"] == "llama-server"]
        by_round = {b["round"]: b["tok_s"] for b in batches
                    if b["clients"] == n and b["system"] == "llama-server"}
        for system in args.systems:
            mine = [r for r in records if r["clients"] == n and r["system"] == system]
            if not mine:
                continue
            rounds = [b for b in batches if b["clients"] == n and b["system"] == system]
            ratios = [b["tok_s"] / by_round[b["round"]] for b in rounds if b["round"] in by_round]
            walls = [r["wall_s"] for r in mine]
            ttfts = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
            decodes = [r["decode_tok_s"] for r in mine if "decode_tok_s" in r]
            drafted = sum(r["drafted"] or 0 for r in mine)
            counts = [s for s in steps if s["clients"] == n and s["system"] == system]
            row = {
                "clients": n, "system": system,
                "tok_s": statistics.median(b["tok_s"] for b in rounds),
                "tok_s_spread": [round(min(b["tok_s"] for b in rounds), 3),
                                 round(max(b["tok_s"] for b in rounds), 3)],
                "vs_llama_server": statistics.median(ratios) if ratios and peer else None,
                "latency_p50_s": statistics.median(walls), "latency_p95_s": quantile(walls, 0.95),
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                "decode_tok_s_p50": statistics.median(decodes) if decodes else None,
                "fairness": statistics.median(b["fairness"] for b in rounds),
                "acceptance": (sum(r["accepted"] or 0 for r in mine) / drafted) if drafted
                else None,
                "drafted_per_token": drafted / max(sum(len(r["tokens"]) for r in mine), 1),
                "same_as_alone": f"{sum(r['same_as_alone'] for r in mine)}/"
                                 f"{sum(r['checked'] for r in mine)}",
            }
            if counts:
                total = {key: sum(c.get(key, 0) for c in counts) for key in (
                    "steps", "jobs", "forward_s", "wall_s", "llama_decodes")}
                row.update({
                    "forward_share": total["forward_s"] / total["wall_s"],
                    "jobs_per_step": total["jobs"] / max(total["steps"], 1),
                    "decodes_per_step": total["llama_decodes"] / max(total["steps"], 1)
                    if all("llama_decodes" in c for c in counts) else None})
            rows.append(row)
    table = markdown_table(rows, [
        ("clients", "N"), ("system", "system"), ("tok_s", "aggregate tok/s (median)"),
        ("vs_llama_server", "vs llama-server -np N"), ("latency_p50_s", "latency p50 s"),
        ("latency_p95_s", "p95 s"), ("ttft_p50_s", "first block p50 s"),
        ("decode_tok_s_p50", "decode tok/s p50"), ("fairness", "slowest / median s per token"),
        ("acceptance", "acceptance"), ("drafted_per_token", "drafted per token"),
        ("forward_share", "forward / wall"), ("jobs_per_step", "jobs per step"),
        ("decodes_per_step", "llama_decode per step"), ("same_as_alone", "output = alone's")])
    print(table)
    payload = {"command": args.command_line if hasattr(args, "command_line") else None,
               "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "threads": args.threads,
                           "engine": args.engine, "device": args.device,
                           "target": args.target, "drafter": args.drafter,
                           "kernels": getattr(info, "kernels", None),
                           "max_new_tokens": args.max_new_tokens, "rounds": args.rounds},
               "rows": rows, "batches": batches, "verifier_steps": steps, "runs": records,
               "table": table}
    write_json(args.out, payload)
    plot(rows, args, Path(args.out).with_suffix(".png"))
    return payload


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    """Aggregate tok/s against N, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for system in args.systems:
        mine = [r for r in rows if r["system"] == system]
        if mine:
            axes.plot([r["clients"] for r in mine], [r["tok_s"] for r in mine], marker="o",
                      label=system)
    axes.set_xlabel("concurrent clients N")
    axes.set_ylabel("aggregate output tok/s (median)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(args.clients, [str(n) for n in args.clients])
    axes.set_title(f"{args.target} on {args.engine}, {args.threads} threads")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
