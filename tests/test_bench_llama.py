"""The llama.cpp benchmark's report on made-up runs (the runs themselves need real models and
llama-server: ``python -m scripts.bench llama``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.bench.llama import add_arguments, first_difference, report


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3, 4]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1


def test_report_ratios_medians_and_agreement(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workloads", "code", "--out", str(tmp_path / "out.json")])
    runs = []
    for rnd, speed in ((0, 1.0), (1, 2.0)):  # the second round on a machine twice as fast
        runs.append({"round": rnd, "workload": "code", "prompt": "p", "wall_s": 10.0 / speed,
                     "system": "llama-server: target alone", "tokens": [1] * 100})
        runs.append({"round": rnd, "workload": "code", "prompt": "p", "wall_s": 8.0 / speed,
                     "system": "specdec llama.cpp: target alone",
                     "tokens": [1] * 50 + [2] * 50})
        # each system is checked against its own target alone: specdec's, not llama-server's
        runs.append({"round": rnd, "workload": "code", "prompt": "p", "wall_s": 4.0 / speed,
                     "system": "specdec llama.cpp: default (model + lookup, -k auto)",
                     "tokens": [1] * 50 + [2] * 50 if rnd == 0 else [1] * 50 + [2] * 9 + [3]})
        runs.append({"round": rnd, "workload": "code", "prompt": "p", "wall_s": 20.0 / speed,
                     "system": "specdec llama.cpp: default, 4 concurrent sessions",
                     "tokens": [1] * 50 + [2] * 50})
    two_host = [{"workload": "code", "prompt": "p", "rtt_ms": 0.0, "wall_s": 10.0,
                 "system": "llama-server: target alone, 1 core", "tokens": [1] * 100},
                {"workload": "code", "prompt": "p", "rtt_ms": 20.0, "wall_s": 5.0,
                 "system": "specdec llama.cpp default, rtt 20 ms", "tokens": [1] * 100,
                 "drafted": 80, "accepted": 60}]
    payload = report(runs, args, two_host)
    rows = {r["system"]: r for r in payload["rows"]}
    ours = rows["specdec llama.cpp: target alone"]
    assert abs(ours["vs_llama_server"] - 1.25) < 1e-9  # ratios within a round, then the median
    assert ours["same_as_alone"] == "2/2" and ours["first_difference"] is None
    default = rows["specdec llama.cpp: default (model + lookup, -k auto)"]
    assert abs(default["vs_llama_server"] - 2.0) < 1e-9  # 2.5x and 1.5x (60 tokens)
    assert default["same_as_alone"] == "1/2" and default["first_difference"] == 59
    assert rows["specdec llama.cpp: default, 4 concurrent sessions"]["same_as_alone"] == "2/2"
    assert rows["llama-server: target alone"]["same_as_alone"] == "2/2"
    remote = payload["two_host_rows"][1]
    assert abs(remote["vs_one_core"] - 2.0) < 1e-9 and abs(remote["acceptance"] - 0.75) < 1e-9
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == payload["rows"]
