"""Cost files are data, not trust (issue #57, items 4, 5, 14 and 8).

A verifier reads what earlier starts measured on this machine (``$SPECDEC_VERIFY_COSTS``: the
verify costs, and ``--engine auto``'s records of them; ``--dtype fastest``'s choices;
llama.cpp's AMX probe), and anyone who can write that volume can put anything there. A corrupt,
hostile or half-written file or entry is ignored with a warning and measured again: the
verifier starts, reports costs it timed itself and serves. Writers lock and write under names
of their own, so writers in threads and processes at once lose no record and a reader never
sees half a file. Also: a session context below the warm-up's is one line, not a traceback,
and the scheduler's record of recently seen sessions stays bounded without batching.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from shared.engines.target import VERIFY_KS, verify_costs_path
from tests.support.cost_writers import Timed, write_records
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.tiny_models import build_tokenizer, save_tiny, save_tiny_qwen2
from verifier_service.cli import load_target, parse_settings
from verifier_service.settings import Settings, load_engine

ROOT = Path(__file__).resolve().parents[1]
TIMED_KS = [0, 1, 2, 3, 4, 6, 8]  # max_draft_tokens 8 on a 256-token context: ks up to 8 shown


# -- 4. hostile or corrupt verify-cost files ----------------------------------------------------
def entry(change: Callable[[list[list[Any]]], Any]) -> Callable[[dict[str, Any]], str]:
    """A variant that replaces every entry of a good file with ``change(entry)``."""
    return lambda good: json.dumps({key: change(value) for key, value in good.items()})


ENTRIES: dict[str, Callable[[dict[str, Any]], str]] = {
    "negative": entry(lambda v: [[k, -ms] for k, ms in v]),
    "zero": entry(lambda v: [[k, 0.0] for k, _ in v]),
    "nan": entry(lambda v: [[k, math.nan] for k, _ in v]),  # json.dumps writes NaN
    "infinite": entry(lambda v: [[k, math.inf] for k, _ in v]),
    "huge ms": entry(lambda v: [[k, 1e300] for k, _ in v]),
    "empty list": entry(lambda v: []),
    "huge k": entry(lambda v: [[10**9 + k, ms] for k, ms in v]),
    "k not timed": entry(lambda v: [[k + 5, ms] for k, ms in v]),
    "one k missing": entry(lambda v: v[1:]),
    "strings": entry(lambda v: [[str(k), str(ms)] for k, ms in v]),
    "booleans": entry(lambda v: [[True, ms] for _, ms in v]),
    "not pairs": entry(lambda v: [[k, ms, ms] for k, ms in v]),
    "an object": entry(lambda v: {str(k): ms for k, ms in v}),
    "a number": entry(lambda v: 5),
}
FILES: dict[str, Callable[[dict[str, Any]], str | bytes]] = {
    "truncated": lambda good: json.dumps(good)[: len(json.dumps(good)) // 2],
    "a list": lambda good: json.dumps(list(good.items())),
    "not UTF-8": lambda good: b"\xff\xfe{\x00\x80",
    "empty file": lambda good: "",
}


@pytest.fixture(scope="module")
def good_costs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, dict]]:
    """A tiny GPT-2 and the verify-cost file one start of it writes."""
    root = tmp_path_factory.mktemp("costs")
    model = save_tiny(root / "gpt2", "gpt2", 64, seed=1, init_range=0.3)
    settings = fp32_settings(model, max_draft_tokens=8, max_context=256)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_VERIFY_COSTS", str(root / "good.json"))
        load_engine(settings)
    good = json.loads((root / "good.json").read_text())
    assert len(good) == 1 and checked(next(iter(good.values())))
    yield settings, good


def checked(costs: Any) -> bool:
    """Costs a start timed: every k of the sweep, each a finite time above 0."""
    return (isinstance(costs, list) and len(costs) == 9
            and all(isinstance(ms, float) and math.isfinite(ms) and 0 < ms < 1e5
                    for _, ms in costs))


@pytest.mark.parametrize("variant", [*ENTRIES, *FILES])
def test_a_hostile_cost_file_is_ignored_timed_again_and_served(
        variant: str, good_costs: tuple[Settings, dict], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    settings, good = good_costs
    path = tmp_path / "verify-costs.json"
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(path))
    hostile = (ENTRIES | FILES)[variant](good)
    if isinstance(hostile, bytes):
        path.write_bytes(hostile)
    else:
        path.write_text(hostile)
    caplog.set_level(logging.WARNING)
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        info = http.get("/v1/info").json()
        assert [k for k, _ in info["verify_ms"]] == TIMED_KS
        assert all(math.isfinite(ms) and ms > 0 for _, ms in info["verify_ms"]), info
        created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]})
        assert created.status_code == 200, created.text
        sid, position, last = created.json()["session_id"], created.json()["position"], 4
        for _ in range(3):
            verified = http.post(f"/v1/sessions/{sid}/verify", json={
                "position": position, "last_token": last, "draft_ids": [5, 6],
                "log_uniforms": [-0.1, -0.1], "final_uniform": 0.5})
            assert verified.status_code == 200, verified.text
            position, last = verified.json()["position"], verified.json()["next_token"]
        generated = http.post("/v1/generate", json={"prompt_ids": [2, 3], "max_new_tokens": 6})
        assert generated.status_code == 200, generated.text
    warned = [r for r in caplog.records
              if r.levelno == logging.WARNING and str(path) in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    # measured again and kept: the next start reads its own figures back
    again = json.loads(path.read_text())
    assert set(again) == set(good) and checked(next(iter(again.values()))), again


def test_a_good_cost_file_is_read_back_without_a_warning(
        good_costs: tuple[Settings, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The control: the start's own file is read back, silently."""
    settings, good = good_costs
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "verify-costs.json"))
    verify_costs_path().write_text(json.dumps(good))
    caplog.set_level(logging.WARNING)
    engine = load_engine(settings)
    assert all(ms > 0 for _, ms in engine.info.verify_ms)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_int8_never_copies_a_poisoned_cost_into_autos_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 engine's start records its verify costs for ``--engine auto``; a negative
    cost read back was copied there (and, priced below nothing, won every later choice)."""
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "verify-costs.json"))
    model = save_tiny_qwen2(tmp_path / "qwen2", 256)
    settings = Settings(model=str(model), engine="int8", threads=1,  # type: ignore[arg-type]
                        max_context=64, kv_budget_tokens=256)
    load_engine(settings)
    good = json.loads(verify_costs_path().read_text())
    assert any(key.startswith("auto|") for key in good)
    poisoned = {key: ({name: [[k, -ms] for k, ms in pairs] for name, pairs in value.items()}
                      if key.startswith("auto|") else [[k, -ms] for k, ms in value])
                for key, value in good.items()}
    verify_costs_path().write_text(json.dumps(poisoned))
    engine = load_engine(settings)
    assert engine.info.verify_ms and all(ms > 0 for _, ms in engine.info.verify_ms)
    after = json.loads(verify_costs_path().read_text())
    records = [pairs for key, value in after.items() if key.startswith("auto|")
               for pairs in value.values()]
    assert records and all(ms > 0 for pairs in records for _, ms in pairs), after


# -- auto's records, the dtype choices and the AMX probe: the other caches read at start --------
def test_hostile_engine_records_are_not_priced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from shared.engines.choice import Workload, _entry, _key, price, record_costs, recorded_costs

    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "verify-costs.json"))
    chosen = Settings(model="m", threads=1, max_context=256)  # type: ignore[arg-type]
    target, options = chosen.target_options(), chosen.engine_options()
    good = [[0, 80.0], [1, 127.0], [4, 262.0]]
    hostile = {"int8": [[0, -130.0], [1, -136.0]], "w4a8": [["a", "b"]],
               "llama-cpp": good}
    verify_costs_path().write_text(json.dumps({_key(target): {
        _entry(name, options[name]): pairs for name, pairs in hostile.items()}}))
    caplog.set_level(logging.WARNING)
    costs = recorded_costs(target, options, ["llama-cpp", "int8", "w4a8"])
    assert costs == {"llama-cpp": [(0, 80.0), (1, 127.0), (4, 262.0)]}
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    choice = price(["llama-cpp", "int8"], costs, Workload(sessions=8))
    assert choice.engine == "llama-cpp" and "int8 not measured here yet" in choice.why
    # a record that is not an object is replaced, never a traceback; poison is never kept
    verify_costs_path().write_text(json.dumps({_key(target): [1, 2]}))
    assert recorded_costs(target, options, ["int8"]) == {}
    record_costs(target, "int8", options["int8"], [(0, -1.0)])
    record_costs(target, "int8", options["int8"], [(0, 130.0), (1, 136.0)])
    assert recorded_costs(target, options, ["int8"]) == {"int8": [(0, 130.0), (1, 136.0)]}
    # another engine option (int8's outliers) is another record
    other = Settings(model="m", threads=1, max_context=256,  # type: ignore[arg-type]
                     int8_outliers=8).engine_options()
    assert recorded_costs(target, other, ["int8"]) == {}


@pytest.mark.parametrize("choice", ['"float64"', "5", "null", "[1]", '{"a": 1}'])
def test_a_hostile_dtype_choice_is_measured_again(choice: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from shared.engines.transformers.dtype_choice import cache_key, cache_path, load_fastest
    from shared.models.catalog import load_causal_lm

    monkeypatch.setenv("SPECDEC_DTYPE_CACHE", str(tmp_path / "dtype-choices.json"))
    model = save_tiny(tmp_path / "llama", "llama", 64, seed=3)
    spec = str(model)
    cache_path().write_text(f'{{"{cache_key(spec)}": {choice}}}'.replace("\\", "\\\\"))
    timed = []

    def measure(m: Any) -> dict[int, float]:
        timed.append(next(m.parameters()).dtype)
        return {1: 1.0 if timed[-1] == torch.float32 else 2.0}

    caplog.set_level(logging.WARNING)
    loaded, chosen = load_fastest(spec, lambda dt: load_causal_lm(spec, dt, torch.device("cpu")),
                                  measure)
    assert len(timed) == 2 and chosen.dtype == torch.float32 and not chosen.cached
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == (
        0 if choice == "null" else 1)
    assert json.loads(cache_path().read_text()) == {cache_key(spec): "float32"}


@pytest.mark.parametrize("hostile", [{"no-amx": 5}, {"no-amx": ["x"]}, {"no-amx": "abc"},
                                     "MACHINE-yes", [1, 2]])
def test_a_hostile_amx_record_is_probed_again(hostile: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    from shared.engines.llama_cpp import runtime

    cache = tmp_path / "amx.json"
    monkeypatch.setenv("SPECDEC_LLAMA_AMX_CACHE", str(cache))
    monkeypatch.delenv("SPECDEC_LLAMA_AMX", raising=False)
    monkeypatch.setattr(runtime, "probe_amx", lambda path, threads: "amx-ran")
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"GGUF")
    if hostile == "MACHINE-yes":
        hostile = {runtime._amx_machine_key(): "yes"}
    cache.write_text(json.dumps(hostile))
    assert runtime.amx_works(str(weights), 1) is True
    assert json.loads(cache.read_text())[runtime._amx_machine_key()] is True


# -- 5. concurrent writers ----------------------------------------------------------------------
def test_concurrent_writers_lose_nothing_and_readers_never_see_half_a_file(
        tmp_path: Path) -> None:
    """4 processes of 5 threads each record 10 verify costs (200 records, each a
    read-modify-write of one file; threads of one process share its PID, as compose replicas
    do, each PID 1 in its container) while this process reads the file back to back."""
    path = tmp_path / "verify-costs.json"
    env = {**os.environ, "SPECDEC_VERIFY_COSTS": str(path), "PYTHONPATH": str(ROOT)}
    code = "import sys; from tests.support.cost_writers import write_records as w; " \
           "w(sys.argv[1], 5, 10)"
    writers = [subprocess.Popen([sys.executable, "-c", code, f"p{p}"], env=env, cwd=ROOT)
               for p in range(4)]
    reads = invalid = 0
    while any(writer.poll() is None for writer in writers):
        try:
            json.loads(path.read_bytes())
        except FileNotFoundError:
            continue
        except ValueError:
            invalid += 1
        reads += 1
    assert [writer.wait() for writer in writers] == [0] * 4
    records = json.loads(path.read_text())
    assert len(records) == 200, f"{200 - len(records)} of 200 records lost"
    assert all(value == [[k, 1.5 + k] for k in VERIFY_KS]
               for value in records.values())
    assert invalid == 0, f"{invalid} of {reads} reads saw invalid JSON"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_threads_of_one_process_lose_nothing(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(tmp_path / "verify-costs.json"))
    write_records("same-pid", threads=8, each=25)
    assert len(json.loads(verify_costs_path().read_text())) == 200


# -- 14. a session context below the warm-up's --------------------------------------------------
@pytest.mark.parametrize("flags", [["--max-context", "8"], ["--kv-budget-tokens", "8"],
                                   ["--max-context", "31"]])
def test_a_context_too_short_is_one_line(flags: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--engine int8 --max-context 8`` exited with the warm-up's traceback; now one line
    naming the flag and the minimum, before anything loads."""
    model = save_tiny_qwen2(tmp_path / "qwen2", 256)
    capsys.readouterr()  # what saving the model printed (a progress bar) is not the error
    with pytest.raises(SystemExit) as exited:
        settings = parse_settings(["--model", str(model), "--engine", "int8", "--threads", "1",
                                   *flags])
        load_target(settings)  # the old code got this far, and raised from the warm-up
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and flags[0] in lines[0] and "at least 32" in lines[0], lines


def test_a_model_whose_own_limit_is_too_short_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "short"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_layer=1, n_embd=16, n_head=2, n_positions=16,
                               eos_token_id=1, bos_token_id=1)).save_pretrained(folder)
    build_tokenizer(64).save_pretrained(folder)
    settings = fp32_settings(folder, max_context=0, threads=1)
    capsys.readouterr()  # what saving the model printed (a progress bar) is not the error
    with pytest.raises(SystemExit) as exited:
        load_target(settings)
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines()
             if not line.startswith("Loading weights:")]  # transformers' progress bar
    assert len(lines) == 1 and "16 tokens" in lines[0] and "at least 32" in lines[0], lines


# -- 8. the scheduler's record of recently seen sessions ----------------------------------------
def seen_after(max_batch_size: int, calls: int, pause_s: float = 0.0) -> int:
    """Sessions the scheduler still remembers after ``calls`` one-call sessions with long ids
    (and, after ``pause_s``, one more call)."""
    from tests.test_scheduler import FakeEngine, FakeJob
    from verifier_service.scheduling.scheduler import Scheduler

    async def inline(fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def main() -> int:
        scheduler = Scheduler(FakeEngine(), inline, max_batch_size,  # type: ignore[arg-type]
                              max_batch_tokens=2048, batch_wait_ms=0.0, max_queue=256)
        scheduler.start()
        for i in range(calls):
            await scheduler.submit(FakeJob(f"{i:08d}-" + "x" * 200, [1]))  # type: ignore[arg-type]
        if pause_s:
            await asyncio.sleep(pause_s)
            await scheduler.submit(FakeJob("last", [1]))  # type: ignore[arg-type]
        await scheduler.stop()
        return len(scheduler._last_seen)

    return asyncio.run(main())


def test_sessions_seen_are_not_kept_without_batching() -> None:
    """--no-batching: nothing reads when a session was last seen, and every session ever
    seen was kept (+237 MiB after 30k calls with long ids)."""
    assert seen_after(max_batch_size=1, calls=2000) == 0


def test_sessions_seen_are_kept_a_second_with_batching() -> None:
    assert seen_after(max_batch_size=16, calls=500, pause_s=1.1) <= 1


def test_a_home_that_cannot_be_written_is_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A home that cannot be written (a read-only volume): one warning, costs timed, no
    traceback, nothing left behind."""
    home = tmp_path / "ro"
    home.mkdir()
    monkeypatch.setenv("SPECDEC_VERIFY_COSTS", str(home / "verify-costs.json"))
    home.chmod(0o500)
    try:
        if os.access(home, os.W_OK):
            pytest.skip("running as root: a read-only folder is writable")
        caplog.set_level(logging.WARNING)
        costs = Timed().measured_verify_ms(0, [1] * 16, "model")
        assert costs and len([r for r in caplog.records if "cannot record" in r.getMessage()]) == 1
    finally:
        home.chmod(0o700)
    assert not list(home.iterdir())

