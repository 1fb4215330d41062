"""The benchmark suite end to end on tiny fp32 models: every system runs, greedy outputs of all
systems equal the target's, and the JSON, CSV, Markdown and plots are written and agree."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from scripts.bench import report as bench_report
from scripts.bench.__main__ import main as bench

pytestmark = pytest.mark.slow


def test_quick_suite_writes_consistent_results(tiny_models: dict[str, Path],
                                               tmp_path: Path) -> None:
    out = tmp_path / "suite"
    payload = bench([
        "suite", "--target", str(tiny_models["gpt2-target"]), "--drafter",
        str(tiny_models["gpt2-drafter"]), "--dtype", "float32", "--threads", "1", "--quick",
        "--out", str(out)])
    rows, runs = payload["rows"], payload["runs"]
    systems = {r["system"] for r in rows if r["suite"] == "systems"}
    assert systems == {"target alone", "specdec model", "specdec ngram",
                       "specdec prompt-lookup", "specdec bigram", "HF generate", "HF assisted",
                       "HF prompt lookup", "target beam"}
    assert {r["suite"] for r in rows} == set(bench_report.SUITES)
    # fp32: every greedy system reproduces the target alone, token for token.
    greedy = [r for r in runs if r["temperature"] == 0
              and r["system"] not in ("target alone", "target beam")]
    assert greedy and all(r["first_mismatch"] is None for r in greedy)
    for r in runs:
        if r["system"].startswith("specdec") and r["verify_calls"]:
            assert r["predicted_speedup"] > 0 and r["cost_ratio"] >= 0
            assert r["achieved_over_predicted"] == pytest.approx(
                r["speedup"] / r["predicted_speedup"], rel=1e-3)
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == len(runs)
    with (out / "runs.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == len(runs)
    report = (out / "report.md").read_text()
    assert "| code | specdec model |" in report
    beam = [r for r in runs if r["system"] == "target beam" and r["workload"] == "code"]
    assert beam and beam[0]["text"] in report and "beam search vs greedy (code)" in report
    for png in ("speedup_vs_k.png", "context_length.png", "per_position_acceptance.png",
                "achieved_vs_predicted.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # Rebuilding from the saved runs gives the same rows.
    rebuilt = bench(["report", str(out / "results.json"), "--out", str(tmp_path / "again")])
    assert rebuilt["rows"] == rows


def test_predicted_speedup_formula() -> None:
    # Leviathan et al. (2023): (1 - a^(k+1)) / ((1 - a)(k c + 1)).
    assert bench_report.predicted_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert bench_report.predicted_speedup(0.8, 4, 0.25) == pytest.approx(
        (1 - 0.8**5) / 0.2 / 2.0)
    assert bench_report.predicted_speedup(1.0, 3, 0.0) == 4.0
    assert bench_report.predicted_speedup(0.5, 0, 0.3) == 1.0


def test_drafter_variants_and_workload_filter(tiny_models: dict[str, Path],
                                              tmp_path: Path) -> None:
    payload = bench([
        "suite", "--target", str(tiny_models["gpt2-target"]), "--drafter",
        str(tiny_models["gpt2-drafter"]), "--dtype", "float32", "--threads", "1", "--quick",
        "--no-hf", "--suites", "systems", "--workloads", "english", "--drafters",
        "model-confident", "model-auto", "--draft-min-prob", "0.9", "--out", str(tmp_path)])
    rows = payload["rows"]
    assert {r["workload"] for r in rows} == {"english"}
    by_system = {r["system"]: r for r in rows}
    assert set(by_system) == {"target alone", "specdec model-confident", "specdec model-auto",
                              "target beam"}
    assert by_system["target beam"]["k"] == "4"
    assert by_system["specdec model-auto"]["k"] == "auto"
    # A high confidence bar stops blocks early: fewer drafts per call than k = 4.
    assert by_system["specdec model-confident"]["mean_k"] < 4
    assert all(r["first_mismatch"] is None for r in payload["runs"]
               if r["system"] not in ("target alone", "target beam"))


def test_batching_and_profile_run_on_tiny_models(tiny_models: dict[str, Path],
                                                 tmp_path: Path) -> None:
    batching = bench(["batching", "--target", "tiny", "--dtype", "float32", "--threads", "1",
                      "--clients", "1", "3", "--max-new-tokens", "6",
                      "--out", str(tmp_path / "batching.json")])
    rows = batching["rows"]
    assert [(r["batching"], r["clients"]) for r in rows] == [(True, 1), (True, 3), (False, 1),
                                                           (False, 3)]
    # Greedy clients get the same tokens whether their blocks were batched or not.
    assert rows[1]["outputs"] == rows[3]["outputs"] and rows[3]["mean_batch_size"] == 1.0
    assert json.loads((tmp_path / "batching.json").read_text())["rows"] == rows
    profile = bench(["profile", "--target", str(tiny_models["gpt2-target"]), "--drafter",
                     str(tiny_models["gpt2-drafter"]), "--dtype", "float32", "--threads", "1",
                     "--context", "20", "-k", "2", "--repeats", "2",
                     "--out", str(tmp_path / "profile.json")])
    components = [r["component"] for r in profile["rows"]]
    assert len(components) == 13 and all(r["ms"] > 0 for r in profile["rows"])
    assert sum("next turn" in c for c in components) == 2


def test_gateway_bench_runs_on_tiny_models(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    payload = bench([
        "gateway", "--target", str(tiny_models["gpt2-target"]), "--drafter",
        str(tiny_models["gpt2-drafter"]), "--dtype", "float32", "--threads", "1",
        "--max-new-tokens", "8", "--prompts", "2", "--concurrency", "1", "2",
        "--out", str(tmp_path / "gateway.json")])
    rows = payload["rows"]
    assert {(r["concurrency"], r["method"]) for r in rows} == {
        (c, m) for c in (1, 2) for m in ("direct client", "gateway", "gateway, streamed")}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["vs_direct"] == 1.0 for r in rows if r["method"] == "direct client")
    assert json.loads((tmp_path / "gateway.json").read_text())["rows"] == rows



def test_client_bench_runs_every_section_on_tiny_models(tiny_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """The per-client benchmark's pipeline: greedy (every system equal to the target), sampling,
    and the pinned two-host section with and without overlap."""
    payload = bench([
        "client", "--target", str(tiny_models["gpt2-target"]), "--drafter",
        str(tiny_models["gpt2-drafter"]), "--dtype", "float32", "--threads", "1",
        "--max-new-tokens", "10", "--two-host-max-new-tokens", "6", "--prompts-per-workload",
        "1", "--workloads", "code", "english", "--rtts", "0", "20", "--two-host-workloads",
        "english",
        "--systems", "hf", "hf assisted k=2", "hf lookup k=4", "specdec alone",
        "specdec model k=2 tree=2", "specdec default", "specdec ngram k=auto",
        "--sampling-systems", "hf", "specdec default", "specdec default reproducible",
        "--out", str(tmp_path / "client.json")])
    runs = payload["runs"]
    greedy = [r for r in runs if r["section"] == "greedy"]
    assert len(greedy) == 2 * 7 and all(r["matches_target"] for r in greedy)
    assert {r["section"] for r in runs} == {"greedy", "sampling", "two-host"}
    assert {(r["rtt_ms"], r["system"]) for r in runs if r["section"] == "two-host"} == {
        (rtt, s) for rtt in (0.0, 20.0)
        for s in ("hf", "specdec default", "specdec default overlap")}
    rows = payload["rows"]
    assert all(r["all"] > 0 for r in rows)
    assert [r["all"] for r in rows if r["system"] == "hf"] == [1.0] * 4  # its own baseline
    assert {r["workload"] for r in runs if r["section"] == "two-host"} == {"english"}
    assert json.loads((tmp_path / "client.json").read_text())["rows"] == rows


def test_calls_bench_counts_calls_and_server_cpu(tmp_path: Path) -> None:
    """The HTTP-layer benchmark on its tiny target: clients in a separate process make calls,
    the verifier's CPU per call and the batch sizes come back."""
    payload = bench(["calls", "--sessions", "1", "3", "--seconds", "1", "--client-processes",
                     "1", "--out", str(tmp_path / "calls.json")])
    assert [r["sessions"] for r in payload["rows"]] == [1, 3]
    assert all(r["calls"] > 0 and r["server_cpu_us_per_call"] > 0 for r in payload["rows"])
    assert payload["rows"][0]["mean_batch"] == 1.0
    assert json.loads((tmp_path / "calls.json").read_text())["rows"] == payload["rows"]
