"""A forward whose rows come out NaN or infinite fails that call alone: a 500 naming the
engine, nothing committed, counted in /metrics; the batch's other steps are decided as if it
were not there, and the session serves again. The control: the same rows finite are decided."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch

from shared.engines.target import BatchForward, ForwardItem, Step
from shared.engines.w4a8.target import W4A8Engine
from shared.protocol.acceptance import Block
from shared.protocol.sampling import SamplingConfig
from tests.support.live_server import LiveServer
from tests.test_w4a8_engine import engine_of, w4a8_settings

POISON = 250  # an item holding this token gets NaN rows


class Fixed(BatchForward):
    """Rows of 8 ids, the best one the item's first token + 1; NaN where it holds POISON."""

    def __init__(self) -> None:
        self.kept: list[list[int]] = []

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        rows: list[torch.Tensor | None] = []
        for item in items:
            out = torch.zeros(len(item.token_ids), 8)
            out[:, (item.token_ids[0] + 1) % 8] = 5.0
            if POISON in item.token_ids:
                out[-1, 3] = float("nan")
            rows.append(out)
        return rows

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        self.kept.append(path)


def step(slot: int, tokens: list[int]) -> Step:
    block = Block(tokens[1:], None, [-1.0] * (len(tokens) - 1), 0.5, SamplingConfig(0.0), 10)
    return Step(ForwardItem(slot, 10, tokens, True), block)


def test_a_non_finite_step_fails_alone_and_its_neighbour_is_decided() -> None:
    engine = Fixed()
    alone = engine.run([step(0, [1, 2])])[0]
    results = engine.run([step(0, [1, 2]), step(1, [4, POISON])])
    assert not results[0].non_finite and alone.verdict is not None
    decided = results[0].decided()
    assert (decided.num_accepted, decided.next_token) == (alone.verdict.num_accepted,
                                                          alone.verdict.next_token)
    assert results[1].non_finite and results[1].verdict is None
    # control: the same step without the poison is decided
    assert engine.run([step(1, [4, 5])])[0].verdict is not None


class Poisoned(W4A8Engine):
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        rows = super().forward(items)
        return [r if r is None or POISON not in item.token_ids else r * float("nan")
                for r, item in zip(rows, items, strict=True)]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_call_whose_rows_are_not_finite_is_a_500_and_the_session_serves_on(
        q4k: dict[str, Path]) -> None:
    engine = engine_of(q4k["target"], engine=Poisoned, slots=4)
    with LiveServer(w4a8_settings(q4k["target"]), engine) as live:
        http = httpx.Client(base_url=live.url, timeout=60)
        opened: Any = http.post("/v1/sessions", json={"prompt_ids": [5, 6, 7]}).json()
        verify = f"/v1/sessions/{opened['session_id']}/verify"
        body = {"position": 3, "last_token": 7, "draft_ids": [POISON], "log_uniforms": [-1.0],
                "final_uniform": 0.5}
        answer = http.post(verify, json=body)
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
        assert error["code"] == "engine_non_finite" and "w4a8" in error["message"]
        assert metric(live.url, "specdec_verifier_non_finite_calls_total") == 1
        # nothing was committed: the same position serves an ordinary block
        ok = http.post(verify, json={**body, "draft_ids": [9]})
        assert ok.status_code == 200, ok.text
        assert ok.json()["position"] >= 4
