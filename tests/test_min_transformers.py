"""The oldest supported transformers (5.17, the GPU machine's; pyproject's lower bound), next to
the one the suite runs on: `make install` puts it in .venv/transformers-min (no dependencies; it
needs huggingface-hub < 2, also there). Each test runs a subprocess with it first on the path
and, as on the GPU machine, without the `openai` package (tests/support/no_openai)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MIN_TRANSFORMERS = ROOT / ".venv" / "transformers-min"
MIN_VERSION = "5.17.0"


def run_under_min(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    assert (MIN_TRANSFORMERS / "transformers").is_dir(), (
        f"{MIN_TRANSFORMERS} is missing: `make install` puts transformers=={MIN_VERSION} there")
    path = os.pathsep.join([str(ROOT / "tests" / "support" / "no_openai"), str(MIN_TRANSFORMERS),
                            str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_drafters_keep_their_cache_on_the_oldest_transformers() -> None:
    """transformers 5.17 ignores the `cache=` keyword that 5.24 wants: the drafters' caches
    stayed empty (a crop error on the second block). Every drafted token must equal a full
    forward's argmax, causal and encoder-decoder."""
    done = run_under_min(["-m", "tests.support.min_transformers_check"], 300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["transformers"] == MIN_VERSION
    assert result["causal"] == {"drafted": 12, "mismatches": 0}
    assert result["seq2seq"] == {"drafted": 12, "mismatches": 0}
    assert result["plain_step_ms"] > 0 and result["reloaded"] == "LlamaForCausalLM"


def test_gpu_smoke_script_on_the_gpu_machines_software(tmp_path: Path) -> None:
    """The first command a lent GPU machine runs, on its transformers and without `openai`."""
    out = tmp_path / "smoke.json"
    done = run_under_min(["-m", "scripts.bench", "gpu-smoke", "--device", "cpu", "--out",
                          str(out)], 240)
    assert "all checks passed" in done.stdout
    assert json.loads(out.read_text())["passed"]


@pytest.mark.slow
def test_gpu_bench_dry_run_on_the_gpu_machines_software(tmp_path: Path) -> None:
    """The GPU benchmark's whole pipeline on a tiny random Qwen-shaped pair on CPU, on
    transformers 5.17 and without `openai` (its verifier subprocess inherits the same path): it
    measures nothing useful here; it proves the command works before a GPU lease is spent."""
    out = tmp_path / "gpu.json"
    run_under_min([
        "-m", "scripts.bench", "gpu", "--shape", "tiny", "--device", "cpu", "--dtype",
        "float32", "--ks", "0", "2", "--calls", "2", "--clients", "2", "--max-new-tokens",
        "4", "--blocks", "1", "5", "--batches", "2", "--call-sessions", "2", "--call-seconds",
        "0.5", "--client-processes", "1", "--out", str(out)], 480)
    payload = json.loads(out.read_text())
    assert payload["machine"]["transformers"] == MIN_VERSION
    assert [r["new_tokens"] for r in payload["raw_forward"]] == [1, 5]
    assert [r["k"] for r in payload["served_calls"]] == [0, 2]
    assert all(r["round_trip_ms"] >= r["inside_server_ms"] > 0 for r in payload["served_calls"])
    assert [r["k"] for r in payload["served_calls_cuda_graphs"]] == [0, 2]
    assert payload["target_alone"]["served_tok_s"] > 0
    assert all(row["equal"] for row in payload["aggregate_table"])
    assert payload["drafter"]["plain_c"] > 0 and payload["drafter"]["cuda_graphs_c"] > 0
    [engine] = payload["batched_engine"]
    assert engine["batch"] == 2 and engine["padded_ms"] > 0 and engine["device_sampled_ms"] > 0
    [http] = payload["http_layer"]
    assert http["sessions"] == 2 and http["calls"] > 0 and http["server_cpu_us_per_call"] > 0
    # written after every section, with each section's time; the verifiers' output kept
    assert list(payload["section_s"]) == [
        "models", "raw_forward", "batched_engine", "served_calls", "target_alone",
        "served_calls_cuda_graphs", "aggregate", "drafter", "http_layer"]
    assert (tmp_path / "verifier-served.log").stat().st_size > 0
