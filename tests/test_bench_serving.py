"""The serving benchmark: its report on made-up runs, and one short real run of the whole
pipeline on a tiny GGUF pair (no llama-server: ``python -m scripts.bench serving`` runs it on
the real models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench.__main__ import build_parser, main
from scripts.bench.serving import report


def args_of(*argv: str) -> object:
    return build_parser("serving").parse_args(["serving", *argv])


def run_of(system: str, n: int, rnd: int, client: int, wall: float, tokens: list[int],
           prompt: str = "p") -> dict:
    return {"clients": n, "round": rnd, "system": system, "client": client, "prompt": prompt,
            "tokens": tokens, "wall_s": wall, "ttft_s": None if "alone" in system else 1.0,
            "drafted": 10 if system == "lookup" else None,
            "accepted": 5 if system == "lookup" else None}


def test_report_per_round_ratios_fairness_and_identity(tmp_path: Path) -> None:
    args = args_of("--clients", "2", "--systems", "llama-server", "alone", "lookup",
                   "--out", str(tmp_path / "serving.json"))
    runs = []
    for rnd, speed in ((0, 1.0), (1, 2.0)):  # the second round on a machine twice as fast
        for c in range(2):
            runs.append(run_of("llama-server", 2, rnd, c, 10.0 / speed, [1] * 40,
                               prompt=f"p{c}"))
            runs.append(run_of("alone", 2, rnd, c, 8.0 / speed, [1] * 40, prompt=f"p{c}"))
            # client 1 of round 1 parts from the target alone at token 30, and is slow
            tokens = [1] * 40 if (rnd, c) != (1, 1) else [1] * 30 + [2] * 10
            runs.append(run_of("lookup", 2, rnd, c, (8.0 if c == 0 else 12.0) / speed,
                               tokens, prompt=f"p{c}"))
    payload = report(runs, [], args, None)
    rows = {r["system"]: r for r in payload["rows"]}
    assert rows["alone"]["vs_llama_server"] == pytest.approx(1.25)  # within a round
    assert rows["alone"]["same_as_alone"] == "4/4"
    assert rows["lookup"]["same_as_alone"] == "3/4"
    assert rows["lookup"]["vs_llama_server"] == pytest.approx(80 / 12 / 8)
    assert rows["lookup"]["fairness"] == pytest.approx(12 / 10)  # slowest / median s a token
    assert rows["lookup"]["acceptance"] == pytest.approx(0.5)
    assert rows["llama-server"]["tok_s"] == pytest.approx((8 + 16) / 2)  # rounds' median
    assert json.loads((tmp_path / "serving.json").read_text())["rows"] == payload["rows"]
    assert (tmp_path / "serving.png").stat().st_size > 0  # the plot


@pytest.mark.slow  # the serving benchmark end to end: llama-server and our verifier started, timed
def test_a_short_real_run_on_a_tiny_pair(q4k: dict[str, Path], tmp_path: Path) -> None:
    """Two clients on the default (w4a8) verifier, on llama.cpp's exact kernels and on its
    fast ones: every specdec output equals its target alone's, and the verifier's steps are
    counted."""
    target, drafter = q4k["target"], q4k["drafter"]
    payload = main(["serving", "--target", str(target), "--drafter", str(drafter),
                    "--threads", "1", "--clients", "1", "2", "--rounds", "1",
                    "--max-new-tokens", "8", "--systems", "alone", "lookup", "default",
                    "alone-llama", "alone-fast", "--out", str(tmp_path / "serving.json")])
    rows = {(r["clients"], r["system"]): r for r in payload["rows"]}
    assert set(rows) == {(n, s) for n in (1, 2) for s in ("alone", "lookup", "default",
                                                          "alone-llama", "alone-fast")}
    assert payload["machine"]["engine"] == "w4a8"
    for (n, system), row in rows.items():
        assert row["tok_s"] > 0 and row["jobs_per_step"] > 0, (n, system, row)
        checked = row["same_as_alone"].split("/")
        assert checked[0] == checked[1] != "0", (n, system, row["same_as_alone"])
    assert rows[(2, "alone")]["forward_share"] > 0
