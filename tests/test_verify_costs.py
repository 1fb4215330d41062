"""A verifier times its verify forwards at start (``/v1/info`` ``verify_ms``) once per model,
engine, dtype, device, threads and versions on a machine, and reads them back at later starts
(``$SPECDEC_VERIFY_COSTS``): the sweep takes tens of seconds on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shared.engines.target import BatchForward, verify_costs_path


class Timed(BatchForward):
    """Only what ``measured_verify_ms`` uses: the context limit and a counted timing (a sweep
    over every k; ``checks``: the two-k checks of a read-back), ``slower`` times as slow."""

    def __init__(self, max_context: int, slower: float = 1.0) -> None:
        self.info = SimpleNamespace(max_context=max_context)  # type: ignore[assignment]
        self.timings, self.checks, self.slower = 0, 0, slower

    def time_verify_blocks(self, slot: int, ids: list[int], ks: Any = ()) -> list[Any]:
        if len(ks) == 2:
            self.checks += 1
        else:
            self.timings += 1
        return [(k, self.slower * (10.0 * k + 1.5)) for k in ks]


def test_verify_costs_are_timed_once_and_read_back(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "costs.json"))
    assert verify_costs_path() == tmp_path / "costs.json"
    first = Timed(max_context=24)  # 16 cached + k + 1 <= 24: k up to 7
    costs = first.measured_verify_ms(0, [1] * 16, "model A")
    assert costs == [(k, 10.0 * k + 1.5) for k in (0, 1, 2, 3, 4, 6)] and first.timings == 1
    again = Timed(max_context=24)
    assert again.measured_verify_ms(0, [1] * 16, "model A") == costs and again.timings == 0
    assert again.checks == 1  # two ks timed again, within 30% of what they were: read back
    other = Timed(max_context=24)
    other.measured_verify_ms(0, [1] * 16, "model B")  # another model, dtype, machine...
    longer = Timed(max_context=4096)
    assert len(longer.measured_verify_ms(0, [1] * 16, "model A")) == 9  # other ks: timed
    assert other.timings == 1 and longer.timings == 1
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 3
    (tmp_path / "costs.json").write_text("{not json")
    broken = Timed(max_context=24)
    assert broken.measured_verify_ms(0, [1] * 16, "model A") == costs and broken.timings == 1


def test_verify_costs_that_no_longer_hold_are_timed_again(tmp_path: Path,
                                                          monkeypatch: Any) -> None:
    """A sweep timed while something else ran is not read back forever: where two of its
    costs time more than 30% away now, the whole sweep is timed again and kept."""
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "costs.json"))
    busy = Timed(max_context=24, slower=3.0)  # timed while a build ran
    busy.measured_verify_ms(0, [1] * 16, "model A")
    quiet = Timed(max_context=24)
    costs = quiet.measured_verify_ms(0, [1] * 16, "model A")
    assert quiet.checks == 1 and quiet.timings == 1
    assert costs == [(k, 10.0 * k + 1.5) for k in (0, 1, 2, 3, 4, 6)]
    assert Timed(max_context=24, slower=1.2).measured_verify_ms(0, [1] * 16, "model A") == costs
