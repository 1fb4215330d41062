"""The short run of ``python -m scripts.bench attack --classes`` (the holes of issues #42 and
#57, attacked again on tiny models): every class holds, with no unexpected 5xx, no traceback in
any server's log and greedy output unchanged after each."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scripts.bench.attack import add_arguments
from scripts.bench.attack_classes import CLASSES, run_classes


@pytest.mark.slow
def test_every_attack_class_holds(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--classes", "--quick", "--out", str(tmp_path / "attack.json")])
    rows = run_classes(args)["rows"]
    assert [row["class"] for row in rows] == list(CLASSES)
    for row in rows:
        assert row["held"], (row["class"], row["checks"], row["statuses"])
        assert (row["5xx"], row["tracebacks"], row["greedy unchanged"]) == (0, 0, True), row
    assert (tmp_path / "attack.json").exists()
