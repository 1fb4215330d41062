"""``report``: suite results as rows (medians over runs), Markdown, CSV, PNG plots.

Used by ``suite`` after a run, and on its own to rebuild everything from saved results:

  python -m scripts.bench report docs/benchmarks/run1-all-suites.json --out bench_results/again
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

from scripts.bench.common import markdown_table

SUITES = ("systems", "k", "temperature", "context", "rtt")
TARGET = "target alone"
BEAM = "target beam"  # beam search on the verifier, k = the number of beams


# -- metrics -----------------------------------------------------------------------------------
def predicted_speedup(a: float, k: float, c: float) -> float:
    """Leviathan et al. (2023), eq. 1 / thm 3.8: expected speedup with acceptance a, draft
    length k and cost ratio c (one drafter step / one target step)."""
    if k <= 0:
        return 1.0
    expected = (k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return expected / (k * c + 1)


def first_mismatch(tokens: list[int], reference: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(tokens, reference, strict=False)):
        if x != y:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def enrich(record: dict[str, Any], base: dict[str, Any], hf_base: dict[str, Any] | None) -> None:
    """Speedups against the cell's baselines; the predicted speedup from measured a and c."""
    record["speedup"] = round(record["tokens_per_s"] / base["tokens_per_s"], 4)
    if hf_base is not None:
        record["speedup_vs_hf_generate"] = round(record["tokens_per_s"]
                                                 / hf_base["tokens_per_s"], 4)
    calls = record.get("verify_calls")
    if not record["system"].startswith("specdec"):  # no drafts: these would mislead
        for key in ("acceptance_rate", "mean_tokens_per_call", "per_position_acceptance"):
            record.pop(key, None)
    elif calls:
        mean_k = record["drafted_tokens"] / calls
        a = record["acceptance_rate"]
        # c: one drafter step against one target step of the baseline's own decoding.
        draft_step = record["time_s"]["drafting"] / max(record["drafted_tokens"], 1)
        target_step = base["wall_s"] / max(base["new_tokens"], 1)
        c = draft_step / target_step
        pred = predicted_speedup(a, mean_k, c)
        record.update(mean_k=round(mean_k, 3), cost_ratio=round(c, 4),
                      predicted_speedup=round(pred, 4),
                      achieved_over_predicted=round(record["speedup"] / pred, 4))


# -- rows --------------------------------------------------------------------------------------
def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows: medians over prompts and repeats of one (suite, workload, system, k, setting)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        key = (r["suite"], r["workload"], r["system"], str(r["k"]), r["temperature"],
               r["context"], r["rtt_ms"])
        groups.setdefault(key, []).append(r)
    rows = []
    med = statistics.median
    for (suite, workload, system, k, temp, ctx, rtt), runs in groups.items():

        def m(name: str, runs: list[dict[str, Any]] = runs) -> float | None:
            values = [r[name] for r in runs if r.get(name) is not None]
            return round(med(values), 4) if values else None

        per_pos: list[float] = []
        width = max((len(r.get("per_position_acceptance") or []) for r in runs), default=0)
        for i in range(width):
            vals = [r["per_position_acceptance"][i] for r in runs
                    if len(r.get("per_position_acceptance") or []) > i]
            per_pos.append(round(statistics.mean(vals), 3))
        mismatches = [r["first_mismatch"] for r in runs if r.get("first_mismatch") is not None]
        row = {
            "suite": suite, "workload": workload, "system": system, "k": k,
            "temperature": temp, "context": ctx, "rtt_ms": rtt, "runs": len(runs),
            "tokens_per_s": m("tokens_per_s"), "speedup": m("speedup"),
            "speedup_vs_hf_generate": m("speedup_vs_hf_generate"),
            "acceptance_rate": m("acceptance_rate"),
            "mean_tokens_per_call": m("mean_tokens_per_call"),
            "mean_k": m("mean_k"), "cost_ratio": m("cost_ratio"),
            "predicted_speedup": m("predicted_speedup"),
            "achieved_over_predicted": m("achieved_over_predicted"),
            "bytes_per_token": m("bytes_per_token"),
            "per_position_acceptance": per_pos,
            "greedy_same_as_target": (None if temp > 0 or system in (TARGET, BEAM)
                                      else f"{len(runs) - len(mismatches)}/{len(runs)}"),
            "first_mismatch": min(mismatches) if mismatches else None,
            "time_split_s": {key: round(med([r["time_s"][key] for r in runs]), 3)
                             for key in ("drafting", "verify_rtt", "verify_forward", "client")}
            if all("time_s" in r for r in runs) else None,
        }
        rows.append(row)
    return rows


# -- output ------------------------------------------------------------------------------------
COLUMNS = {
    "systems": [("workload", "workload"), ("system", "system"), ("k", "k"),
                ("tokens_per_s", "tok/s"), ("speedup", "vs target alone"),
                ("speedup_vs_hf_generate", "vs HF generate"), ("acceptance_rate", "acceptance"),
                ("mean_tokens_per_call", "tokens/call"), ("predicted_speedup", "predicted"),
                ("achieved_over_predicted", "achieved/predicted"),
                ("bytes_per_token", "B/token"), ("greedy_same_as_target", "= target")],
    "k": [("workload", "workload"), ("system", "system"), ("k", "k"), ("tokens_per_s", "tok/s"),
          ("speedup", "speedup"), ("acceptance_rate", "acceptance"),
          ("mean_tokens_per_call", "tokens/call"),
          ("cost_ratio", "c"), ("predicted_speedup", "predicted"),
          ("achieved_over_predicted", "achieved/predicted"), ("bytes_per_token", "B/token"),
          ("per_position_acceptance", "per-position acceptance")],
    "temperature": [("temperature", "T"), ("workload", "workload"), ("system", "system"),
                    ("tokens_per_s", "tok/s"), ("speedup", "speedup"),
                    ("acceptance_rate", "acceptance"), ("mean_tokens_per_call", "tokens/call")],
    "context": [("context", "context tokens"), ("system", "system"),
                ("tokens_per_s", "tok/s"), ("speedup", "speedup"),
                ("acceptance_rate", "acceptance"), ("mean_tokens_per_call", "tokens/call"),
                ("cost_ratio", "c"), ("greedy_same_as_target", "= target")],
    "rtt": [("rtt_ms", "RTT ms"), ("workload", "workload"), ("system", "system"),
            ("tokens_per_s", "tok/s"), ("speedup", "speedup"),
            ("acceptance_rate", "acceptance"), ("mean_tokens_per_call", "tokens/call"),
            ("greedy_same_as_target", "= target")],
}


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [key for key in r if key not in keys]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({key: json.dumps(v) if isinstance(v, list | dict) else v
                             for key, v in r.items()})


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    k_rows = [r for r in rows if r["suite"] == "k" and r["system"] != TARGET]
    if k_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in sorted({r["system"] for r in k_rows}):
            pts = sorted((int(r["k"]), r["speedup"]) for r in k_rows if r["system"] == system)
            ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="draft length k", ylabel="speedup vs target alone",
               title="Speedup vs k (code, greedy)")
        ax.legend()
        save(fig, "speedup_vs_k.png")
    ctx_rows = [r for r in rows if r["suite"] == "context" and r["system"] != TARGET]
    if ctx_rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for n, system in enumerate(sorted({r["system"] for r in ctx_rows})):
            color = f"C{n}"
            pts = sorted((r["context"], r["speedup"], r["acceptance_rate"])
                         for r in ctx_rows if r["system"] == system)
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system,
                     color=color)
            if pts[0][2] is not None:
                ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=system,
                         color=color)
        ax2.legend()
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax1.set(xscale="log", xlabel="prompt tokens", ylabel="speedup vs target alone",
                title="Speedup vs context length")
        ax2.set(xscale="log", xlabel="prompt tokens", ylabel="acceptance rate",
                title="Acceptance vs context length", ylim=(0, 1))
        ax1.legend()
        save(fig, "context_length.png")
    pos_rows = [r for r in rows if r["suite"] in ("systems", "k") and r["per_position_acceptance"]
                and r["system"].startswith("specdec")]
    if pos_rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
        for r in pos_rows:
            if r["suite"] == "systems" or r["k"] == str(max(int(x["k"]) for x in pos_rows
                                                            if x["suite"] == "k")):
                label = f"{r['system']} / {r['workload']} (k={r['k']})"
                ax.plot(range(1, len(r["per_position_acceptance"]) + 1),
                        r["per_position_acceptance"], marker="o", label=label)
        ax.set(xlabel="draft position i", ylabel="drafts with token i accepted / drafts",
               ylim=(0, 1),
               title="Per-position acceptance")
        ax.legend(fontsize=7)
        save(fig, "per_position_acceptance.png")
    pred_rows = [r for r in rows if r.get("predicted_speedup")]
    if pred_rows:
        fig, ax = plt.subplots(figsize=(5, 5))
        for system in sorted({r["system"] for r in pred_rows}):
            sel = [r for r in pred_rows if r["system"] == system]
            ax.scatter([r["predicted_speedup"] for r in sel], [r["speedup"] for r in sel],
                       label=system)
        top = max(max(r["predicted_speedup"], r["speedup"]) for r in pred_rows) * 1.1
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="achieved = predicted")
        ax.set(xlabel="predicted speedup (Leviathan et al.)", ylabel="achieved speedup",
               title="Achieved vs predicted", xlim=(0, top), ylim=(0, top))
        ax.legend(fontsize=7)
        save(fig, "achieved_vs_predicted.png")
    return written


def report(rows: list[dict[str, Any]], machine: dict[str, Any], command: str) -> str:
    parts = [f"Command: `{command}`", "",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()), ""]
    for suite in SUITES:
        sel = [r for r in rows if r["suite"] == suite]
        if sel:
            parts += [f"### {suite}", "", markdown_table(sel, COLUMNS[suite]), ""]
    return "\n".join(parts)


def beam_texts(records: list[dict[str, Any]], workload: str = "code") -> str:
    """The beam search's and the target's greedy text on one workload, prompt by prompt: the
    quality baseline next to what speculative decoding reproduces."""
    runs = [r for r in records if r["workload"] == workload and r["suite"] == "systems"
            and r["system"] in (BEAM, TARGET) and r.get("repeat", 0) == 0 and "text" in r]
    if not any(r["system"] == BEAM for r in runs):
        return ""
    parts = [f"### beam search vs greedy ({workload})", ""]
    for r in runs:
        label = f"{r['system']}" + (f", {r['k']} beams" if r["system"] == BEAM else "")
        parts += [f"{r['prompt']} - {label}:", "", "```", r["text"].rstrip(), "```", ""]
    return "\n".join(parts)


def write_outputs(out: Path, payload: dict[str, Any], command: str) -> None:
    rows, records = payload["rows"], payload["runs"]
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    write_csv(out / "runs.csv", [{k: v for k, v in r.items() if k != "tokens"} for r in records])
    write_csv(out / "rows.csv", rows)
    text = report(rows, payload["machine"], command)
    beams = beam_texts(records)
    if beams:
        text += "\n" + beams
    (out / "report.md").write_text(text)
    pngs = plot(rows, out)
    print("\n" + text)
    print(f"\nwrote {out}/results.json, runs.csv, rows.csv, report.md and "
          f"{', '.join(p.name for p in pngs)}")


def rebuild(sources: list[str], out: Path, command: str) -> dict[str, Any]:
    """Tables, CSV and plots from earlier results.json files, measuring nothing; a suite found
    in several files is taken from the last."""
    by_suite: dict[str, list[dict[str, Any]]] = {}
    machines = []
    for name in sources:
        data = json.loads(Path(name).read_text())
        machines.append(data["machine"])
        suites: dict[str, list[dict[str, Any]]] = {}
        for run in data["runs"]:
            run.setdefault("source", name)
            suites.setdefault(run["suite"], []).append(run)
        by_suite.update(suites)
    records = [r for suite in SUITES for r in by_suite.get(suite, [])]
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machines[-1], "sources": sources, "rows": aggregate(records),
               "runs": records}
    write_outputs(out, payload, command)
    return payload


def add_arguments(parser: Any) -> None:
    parser.add_argument("results", nargs="+", metavar="RESULTS_JSON",
                        help="results.json files of earlier suite runs (a suite found in "
                        "several: the last file's runs)")
    parser.add_argument("--out", default="bench_results/report")


def run(args: Any) -> dict[str, Any]:
    command = "python -m scripts.bench report " + " ".join(args.results)
    return rebuild(args.results, Path(args.out), command)
