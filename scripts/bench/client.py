"""``client``: per-client speed, specdec's drafting methods next to transformers' best, one run.

Three sections, every system interleaved per prompt, speedup = tok/s over transformers' own
``generate()`` (target alone) on the same prompt in the same run:

  * ``greedy``   every ``--systems`` entry on every prompt (greedy; each also checked equal to
                 the target's greedy output token for token);
  * ``sampling`` ``--sampling-systems`` at T = ``--temperature``, top-p = ``--top-p``;
  * ``two-host`` verifier and client as two machines would see it: the verifier pinned to one
                 core, this process (client, and transformers' target alone) to another, one
                 thread each, with ``--rtts`` ms added per round trip; ``--two-host-systems``
                 (with and without ``overlap``) over the first prompt of each workload.

Systems are strings parsed by ``scripts.bench.systems`` (``hf``, ``hf assisted k=4``,
``specdec alone``, ``specdec model k=auto lookup``, ``specdec default``, ...), run by its
``Runner``, the same as the ``suite`` harness's.

  python -m scripts.bench client                                      # the full table
  python -m scripts.bench client --sections greedy --prompts-per-workload 1 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from typing import Any

import torch

from drafter_client.settings import Sampling
from scripts.bench.common import (
    add_base_arguments,
    fetch_offline_models,
    machine_record,
    markdown_table,
    write_json,
)
from scripts.bench.suite import Prompt, workloads
from scripts.bench.systems import Runner, System
from verifier_service.launch import VerifierProcess

SECTIONS = ("greedy", "sampling", "two-host")
DEFAULT_SYSTEMS = ["hf", "hf assisted k=4", "hf lookup k=10", "specdec alone",
                   "specdec model k=4", "specdec model k=auto", "specdec ngram k=auto",
                   "specdec default"]
DEFAULT_SAMPLING = ["hf", "hf assisted k=4", "specdec model k=4", "specdec default",
                    "specdec default reproducible"]
DEFAULT_TWO_HOST = ["hf", "specdec default", "specdec default overlap"]


def pick_prompts(args: argparse.Namespace) -> list[Prompt]:
    work = workloads(args.prompts_per_workload)
    return [p for w in args.workloads for p in work[w]]


def run_section(name: str, runner: Runner, systems: list[System], prompts: list[Prompt],
                sampling: Sampling, runner_max_new: int,
                rtt_ms: float = 0.0) -> list[dict[str, Any]]:
    """Every system on every prompt, interleaved; one record per run."""
    records: list[dict[str, Any]] = []
    runner.set_rtt(rtt_ms)
    for prompt in prompts:
        ids = runner.encode(prompt.text, prompt.chat)
        runs: dict[str, dict[str, Any]] = {}
        for s in systems:
            run = runner.run(s, ids, sampling, runner_max_new)
            tokens = run.tokens
            runs[s.text] = {"section": name, "workload": prompt.workload,
                            "prompt": prompt.name, "system": s.text, "rtt_ms": rtt_ms,
                            "new_tokens": len(tokens), "tok_s": len(tokens) / run.wall_s,
                            "wall_s": run.wall_s,
                            "mean_tokens_per_call": run.metrics.get("mean_tokens_per_call"),
                            "verify_calls": run.metrics.get("verify_calls"),
                            "tokens": tokens}
            print(f"  {name} rtt={rtt_ms:g} {prompt.name:18s} {s.text:42s} "
                  f"{runs[s.text]['tok_s']:6.2f} tok/s", flush=True)
        base = runs.get("hf")
        for rec in runs.values():
            rec["speedup"] = rec["tok_s"] / base["tok_s"] if base else None
            if sampling.temperature == 0 and base is not None:
                n = min(len(rec["tokens"]), len(base["tokens"]))
                rec["matches_target"] = rec["tokens"][:n] == base["tokens"][:n]
        records.extend(runs.values())
    return records


def summarise(records: list[dict[str, Any]], workloads_: list[str]) -> list[dict[str, Any]]:
    """Median speedup per (section, rtt, system): per workload and over all prompts."""
    rows = []
    keys = sorted({(r["section"], r["rtt_ms"], r["system"]) for r in records},
                  key=lambda key: (SECTIONS.index(key[0]), key[1]))
    order = {r["system"]: i for i, r in enumerate(records)}
    for section, rtt, system in sorted(keys, key=lambda key: (SECTIONS.index(key[0]), key[1],
                                                              order[key[2]])):
        mine = [r for r in records if (r["section"], r["rtt_ms"], r["system"])
                == (section, rtt, system) and r["speedup"] is not None]
        if not mine:
            continue
        row: dict[str, Any] = {"section": section, "rtt_ms": rtt, "system": system}
        for w in workloads_:
            values = [r["speedup"] for r in mine if r["workload"] == w]
            row[w] = statistics.median(values) if values else None
        row["all"] = statistics.median(r["speedup"] for r in mine)
        row["tok_s"] = statistics.median(r["tok_s"] for r in mine)
        if any("matches_target" in r for r in mine):
            row["greedy_equal"] = f"{sum(r.get('matches_target', False) for r in mine)}" \
                                  f"/{len(mine)}"
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, out="bench_results/client.json", max_new_tokens=128)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--workloads", nargs="+", default=["code", "input-grounded", "english"])
    parser.add_argument("--prompts-per-workload", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS)
    parser.add_argument("--sampling-systems", nargs="+", default=DEFAULT_SAMPLING)
    parser.add_argument("--two-host-systems", nargs="+", default=DEFAULT_TWO_HOST)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--rtts", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    parser.add_argument("--two-host-max-new-tokens", type=int, default=64)
    parser.add_argument("--two-host-workloads", nargs="+", default=["code", "english"],
                        help="the two-host section's workloads (their first prompt each)")
    parser.add_argument("--sampling-prompts-per-workload", type=int, default=1)


def _verifier(args: argparse.Namespace, threads: int, cpus: str | None) -> VerifierProcess:
    # A small KV pool: one client at a time needs little, and this process holds two models.
    process = VerifierProcess(["--model", args.target, "--dtype", args.dtype,
                               "--engine", args.engine,
                               "--kv-budget-tokens", "8192", "--max-context", "4096"],
                              threads=threads)
    if cpus is not None:
        process.prefix = ["taskset", "-c", cpus]
    return process


def run(args: argparse.Namespace) -> dict[str, Any]:
    fetch_offline_models(args.target, args.drafter)
    prompts = pick_prompts(args)
    records: list[dict[str, Any]] = []
    parse = lambda texts: [System.parse(t) for t in texts]  # noqa: E731
    torch.set_num_threads(args.threads)
    if "greedy" in args.sections or "sampling" in args.sections:
        every = parse(args.systems) + parse(args.sampling_systems)
        with _verifier(args, args.threads, None) as process:
            runner = Runner(process.url, args.target, args.drafter, args.dtype, every,
                            engine=args.engine)
            runner.warm(every)
            if "greedy" in args.sections:
                records += run_section("greedy", runner, parse(args.systems), prompts,
                                       Sampling(), args.max_new_tokens)
            if "sampling" in args.sections:
                few = [p for w in args.workloads for p in [q for q in prompts
                       if q.workload == w][:args.sampling_prompts_per_workload]]
                records += run_section("sampling", runner, parse(args.sampling_systems),
                                       few, Sampling(temperature=args.temperature,
                                                     top_p=args.top_p, seed=1),
                                       args.max_new_tokens)
            del runner
        gc.collect()  # the next section loads its own models
    if "two-host" in args.sections:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("two-host needs two cores")
        os.sched_setaffinity(0, {cpus[0]})  # this process: the client and transformers
        torch.set_num_threads(1)
        systems = parse(args.two_host_systems)
        work = workloads(1)
        first = [work[w][0] for w in args.two_host_workloads]
        with _verifier(args, 1, str(cpus[1])) as process:
            runner = Runner(process.url, args.target, args.drafter, args.dtype, systems,
                            engine=args.engine)
            runner.warm(systems)
            for rtt in args.rtts:
                records += run_section("two-host", runner, systems, first, Sampling(),
                                       args.two_host_max_new_tokens, rtt)
        os.sched_setaffinity(0, set(cpus))
    rows = summarise(records, args.workloads)
    columns = [("section", "section"), ("rtt_ms", "rtt ms"), ("system", "system"),
               *[(w, w) for w in args.workloads], ("all", "all (median)"),
               ("tok_s", "tok/s"), ("greedy_equal", "= target")]
    print(f"\n{args.target} <- {args.drafter}, {args.dtype}, {args.threads} threads, "
          f"{args.max_new_tokens} new tokens; speedup over transformers' target alone\n")
    print(markdown_table(rows, columns))
    payload = {"machine": machine_record(args), "args": vars(args), "rows": rows,
               "runs": records}
    write_json(args.out, payload)
    return payload
