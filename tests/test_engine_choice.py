"""``--engine auto`` between llama.cpp and the int8 engine, from the costs each start records."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shared.engines.choice import (
    Workload,
    ms_per_token,
    price,
    recorded_costs,
    rows_ms,
)
from shared.models.catalog import offline_gguf_path, offline_model_dir
from tests.support.tiny_gguf import save_quantized_gguf
from verifier_service.settings import Settings, load_engine

# Shaped like docs/benchmarks/cpu_blocks_1204.json: llama.cpp's exact step is cheaper, its
# rows cost nearly a step each; int8's step is dearer, its rows cheap.
LLAMA = [(0, 80.0), (1, 127.0), (3, 262.0), (7, 443.0), (15, 806.0)]
INT8 = [(0, 130.0), (1, 136.0), (3, 142.0), (7, 204.0), (15, 350.0)]


def test_rows_are_priced_between_and_past_the_measured_blocks() -> None:
    assert rows_ms(INT8, 1) == 130.0  # a one-token step, as measured
    assert rows_ms(INT8, 6) == pytest.approx(142.0 + (204.0 - 142.0) * 2 / 4)  # between 4, 8
    assert rows_ms(INT8, 32) == pytest.approx(350.0 + (350.0 - 204.0) * 16 / 8)  # past 16


def test_nothing_to_draft_alone_takes_the_cheaper_step() -> None:
    assert ms_per_token(LLAMA, Workload()) == (80.0, 0)
    assert price(["llama-cpp", "int8"], {"llama-cpp": LLAMA, "int8": INT8},
                  Workload()).engine == "llama-cpp"


def test_many_sessions_or_good_drafts_take_the_cheaper_rows() -> None:
    both = {"llama-cpp": LLAMA, "int8": INT8}
    eight = price(["llama-cpp", "int8"], both, Workload(sessions=8))
    assert eight.engine == "int8"  # 8 rows: 204 / 8 = 25.5 ms a token against 443 / 8
    assert "int8 25.5 ms a token at k=0" in eight.why
    drafts = price(["llama-cpp", "int8"], both, Workload(acceptance=0.8))
    assert drafts.engine == "int8" and ms_per_token(INT8, Workload(acceptance=0.8))[1] >= 3


def test_an_engine_not_measured_yet_leaves_the_first() -> None:
    choice = price(["llama-cpp", "int8"], {"llama-cpp": LLAMA}, Workload(sessions=8))
    assert choice.engine == "llama-cpp" and "int8 not measured here yet" in choice.why


@pytest.fixture()
def both_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A home where the offline target's short name has a GGUF file kept (llama.cpp claims
    it) and a converted folder (the int8 engine can serve it): a tiny Llama, both ways."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "verify-costs.json"))
    name = "qwen2.5-coder-1.5b"
    gguf = save_quantized_gguf(tmp_path / "tiny")
    shutil.copytree(gguf.parent, offline_model_dir(name))
    offline_gguf_path(name).parent.mkdir(parents=True)
    shutil.copy(gguf, offline_gguf_path(name))
    return name


def settings(model: str, engine: str, sessions: int = 1) -> Settings:
    return Settings(model=model, engine=engine, threads=1, max_context=256,  # type: ignore[arg-type]
                    expected_sessions=sessions)


def recorded(model: str) -> dict[str, list[tuple[int, float]]]:
    """What auto prices for ``settings(model, ...)``: the candidates' recorded costs."""
    chosen = settings(model, "auto")
    return recorded_costs(chosen.target_options(), chosen.engine_options(),
                          ["llama-cpp", "int8"])


def test_auto_runs_w4a8_where_it_computes_the_file(both_engines: str) -> None:
    engine = load_engine(settings(both_engines, "auto", sessions=8))
    assert (engine.info.engine, engine.info.kernels, engine.info.engine_choice) == (
        "w4a8", "exact", "")


def test_each_start_records_its_costs_and_auto_prices_them(
        both_engines: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the w4a8 engine cannot serve the file (another quantization), auto prices
    llama.cpp and int8 from their recorded costs."""
    from shared.engines import backend

    monkeypatch.setattr(type(backend("w4a8")), "claims", lambda self, spec, device: False)
    first = load_engine(settings(both_engines, "auto", sessions=8))
    assert (first.info.engine, first.info.kernels) == ("llama-cpp", "exact")
    assert "int8 not measured here yet" in first.info.engine_choice
    assert load_engine(settings(both_engines, "int8")).info.engine == "int8"
    assert set(recorded(both_engines)) == {"llama-cpp", "int8"}
    for sessions in (1, 8):
        # what auto prices: the costs recorded now (each start re-records its engine's costs,
        # re-timed where the earlier ones no longer hold)
        costs = recorded(both_engines)
        chosen = load_engine(settings(both_engines, "auto", sessions))
        cheaper = min(costs, key=lambda name: ms_per_token(costs[name], Workload(sessions))[0])
        assert chosen.info.engine == cheaper
        assert chosen.info.engine_choice.startswith(f"measured costs for {sessions} session")
