"""The GPU smoke script (``python -m scripts.bench gpu-smoke``, issue #24) on CPU: every check
runs and passes here (the graph replay eagerly, no syncs to count), one line each, and its JSON
is written. On the GPU machine's software (transformers 5.17, no ``openai``):
tests/test_min_transformers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench.__main__ import main

CHECKS = ["graph_replay", "host_syncs", "attention", "served_verify", "greedy_generation"]


def test_every_check_passes_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "smoke.json"
    payload = main(["gpu-smoke", "--device", "cpu", "--out", str(out)])
    assert payload["passed"] and list(payload["checks"]) == CHECKS
    assert json.loads(out.read_text())["checks"] == payload["checks"]
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith(("ok ", "FAIL"))]
    assert [line.split()[1].rstrip(":") for line in printed] == CHECKS
    syncs = payload["checks"]["host_syncs"]
    assert all(v["uploads"] == 1 for k, v in syncs.items() if k != "ok")
    assert payload["checks"]["served_verify"]["replies"][0][0] == 4
