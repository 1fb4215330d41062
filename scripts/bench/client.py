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

A system is a name plus settings: ``hf`` (target alone), ``hf assisted k=4`` (a constant
4-token draft; without k transformers' default schedule), ``hf lookup k=10``; ``specdec alone``
(the verifier's ``/v1/generate``); ``specdec model k=4``, ``specdec model k=auto lookup tree=2
overlap``, ``specdec ngram k=auto`` ... (``min_prob=0.4``, ``reproducible`` also parse).
``specdec default`` is the CLI's default setting.

  python -m scripts.bench client                                      # the full table
  python -m scripts.bench client --sections greedy --prompts-per-workload 1 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from drafter_client import SpecDecClient
from drafter_client.api import DEFAULT_K, DEFAULT_OPTIONS, MODEL_FREE_DRAFTERS, DrafterOptions
from scripts.bench.common import (
    add_base_arguments,
    assistant_defaults,
    fetch_offline_models,
    hf_generate,
    machine_record,
    markdown_table,
    write_json,
)
from scripts.bench.suite import Prompt, workloads
from scripts.harness.process import VerifierProcess
from shared.models import load_causal_lm, pick_dtype

SECTIONS = ("greedy", "sampling", "two-host")
DEFAULT_SYSTEMS = ["hf", "hf assisted k=4", "hf lookup k=10", "specdec alone",
                   "specdec model k=4", "specdec model k=auto", "specdec ngram k=auto",
                   "specdec default"]
DEFAULT_SAMPLING = ["hf", "hf assisted k=4", "specdec model k=4", "specdec default",
                    "specdec default reproducible"]
DEFAULT_TWO_HOST = ["hf", "specdec default", "specdec default overlap"]


@dataclass(frozen=True)
class System:
    """One parsed system string."""

    text: str
    kind: str  # "hf" or "specdec"
    method: str  # hf: alone / assisted / lookup; specdec: alone / model / a model-free drafter
    k: str | None = None
    options: DrafterOptions = field(default_factory=DrafterOptions)
    reproducible: bool = False

    @classmethod
    def parse(cls, text: str) -> System:
        words = text.split()
        kind, method, rest = words[0], words[1] if len(words) > 1 else "alone", words[2:]
        if kind not in ("hf", "specdec"):
            raise SystemExit(f"system {text!r}: starts with hf or specdec")
        k, reproducible = None, False
        opts: dict[str, Any] = {"lookup": False}  # a named method alone unless it says lookup
        if method == "default":
            method, k, opts = "model", DEFAULT_K, dataclasses.asdict(DEFAULT_OPTIONS)
        for word in rest:
            key, _, value = word.partition("=")
            if key == "k":
                k = value
            elif key in ("lookup", "overlap"):
                opts[key] = True
            elif key == "no-lookup":
                opts["lookup"] = False
            elif key == "tree":
                opts["tree_width"] = int(value)
            elif key == "min_prob":
                opts["draft_min_prob"] = float(value)
            elif key == "reproducible":
                reproducible = True
            else:
                raise SystemExit(f"system {text!r}: unknown setting {word!r}")
        return cls(text, kind, method, k, DrafterOptions(**opts), reproducible)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class Runner:
    """The verifier clients and transformers' models of one section; runs a system on a prompt."""

    def __init__(self, url: str, args: argparse.Namespace, systems: list[System]) -> None:
        self.args = args
        self.clients: dict[str, SpecDecClient] = {}
        self.base = SpecDecClient(url, None, tokenizer=args.drafter)
        model_client: SpecDecClient | None = None  # one drafter model for every setting
        for s in systems:
            if s.kind != "specdec" or s.method == "alone":
                continue
            if s.method in MODEL_FREE_DRAFTERS:
                self.clients[s.text] = SpecDecClient(url, s.method, tokenizer=args.drafter,
                                                     options=s.options)
            elif model_client is None:
                model_client = self.clients[s.text] = SpecDecClient(
                    url, args.drafter, dtype=args.dtype, options=s.options)
            else:
                self.clients[s.text] = model_client.with_options(s.options)
        dtype = pick_dtype(args.dtype, torch.device("cpu"))
        self.hf_target = load_causal_lm(args.target, dtype, torch.device("cpu"))
        self.hf_drafter = load_causal_lm(args.drafter, dtype, torch.device("cpu"))
        self.hf_defaults = assistant_defaults(self.hf_drafter)

    def encode(self, prompt: Prompt) -> list[int]:
        chat = prompt.chat and getattr(self.base.tokenizer, "chat_template", None) is not None
        return self.base.encode(prompt.text, chat=chat)

    def set_rtt(self, rtt_ms: float) -> None:
        for client in (self.base, *self.clients.values()):
            client.verifier.simulated_rtt_s = rtt_ms / 1e3

    def run(self, s: System, ids: list[int], sampling: Sampling,
            max_new: int | None = None) -> dict[str, Any]:
        max_new = max_new or self.args.max_new_tokens
        kw = {"temperature": sampling.temperature, "top_p": sampling.top_p,
              "seed": sampling.seed}
        if s.kind == "hf":
            return self._hf(s, ids, sampling, max_new)
        if s.method == "alone":
            result = self.base.baseline(ids, max_new_tokens=max_new,
                                        reproducible=s.reproducible, **kw)  # type: ignore[arg-type]
        else:
            result = self.clients[s.text].generate(
                ids, num_draft_tokens=s.k or DEFAULT_K, max_new_tokens=max_new,
                reproducible=s.reproducible, **kw)  # type: ignore[arg-type]
        m = result.metrics
        return {"tokens": result.token_ids, "wall_s": m.wall_s,
                "mean_tokens_per_call": m.to_dict().get("mean_tokens_per_call"),
                "verify_calls": m.verify_calls}

    def _hf(self, s: System, ids: list[int], sampling: Sampling,
            max_new: int) -> dict[str, Any]:
        tokens, wall = hf_generate(
            self.hf_target, ids, max_new, self.base.info.eos_token_ids, method=s.method,
            k=int(s.k) if s.k is not None else None, drafter=self.hf_drafter,
            defaults=self.hf_defaults, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed)
        return {"tokens": tokens, "wall_s": wall}


def pick_prompts(args: argparse.Namespace) -> list[Prompt]:
    work = workloads(args.prompts_per_workload)
    return [p for w in args.workloads for p in work[w]]


def run_section(name: str, runner: Runner, systems: list[System], prompts: list[Prompt],
                sampling: Sampling, rtt_ms: float = 0.0) -> list[dict[str, Any]]:
    """Every system on every prompt, interleaved; one record per run."""
    records = []
    runner.set_rtt(rtt_ms)
    for prompt in prompts:
        ids = runner.encode(prompt)
        runs = {}
        for s in systems:
            result = runner.run(s, ids, sampling)
            tokens = result.pop("tokens")
            runs[s.text] = {"section": name, "workload": prompt.workload,
                            "prompt": prompt.name, "system": s.text, "rtt_ms": rtt_ms,
                            "new_tokens": len(tokens),
                            "tok_s": len(tokens) / result["wall_s"], **result,
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
                               "--kv-budget-tokens", "8192", "--max-context", "4096"],
                              threads=threads)
    if cpus is not None:
        process.cmd = ["taskset", "-c", cpus, *process.cmd]
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
            runner = Runner(process.url, args, every)
            warm = runner.encode(Prompt("warm", "warm", "def f(x):", chat=False))
            for s in {s.text: s for s in every}.values():
                runner.run(s, warm, Sampling(), max_new=8)
            if "greedy" in args.sections:
                records += run_section("greedy", runner, parse(args.systems), prompts,
                                       Sampling())
            if "sampling" in args.sections:
                few = [p for w in args.workloads for p in [q for q in prompts
                       if q.workload == w][:args.sampling_prompts_per_workload]]
                records += run_section("sampling", runner, parse(args.sampling_systems),
                                       few, Sampling(args.temperature, args.top_p, 1))
            del runner
        gc.collect()  # the next section loads its own models
    if "two-host" in args.sections:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("two-host needs two cores")
        os.sched_setaffinity(0, {cpus[0]})  # this process: the client and transformers
        torch.set_num_threads(1)
        max_new, args.max_new_tokens = args.max_new_tokens, args.two_host_max_new_tokens
        systems = parse(args.two_host_systems)
        work = workloads(1)
        first = [work[w][0] for w in args.two_host_workloads]
        with _verifier(args, 1, str(cpus[1])) as process:
            runner = Runner(process.url, args, systems)
            warm = runner.encode(Prompt("warm", "warm", "def f(x):", chat=False))
            for s in systems:
                runner.run(s, warm, Sampling(), max_new=8)
            for rtt in args.rtts:
                records += run_section("two-host", runner, systems, first, Sampling(), rtt)
        args.max_new_tokens = max_new
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
