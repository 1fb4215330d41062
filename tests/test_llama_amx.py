"""llama.cpp's AMX kernels crash some machines that report AMX (this project's 2-core VM: a
segmentation fault in the first multi-token decode of a Q4_K_M file). The runtime tries them
once in a child process and keeps the weights in llama.cpp's plain layout where they fail."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.engines.llama_cpp import runtime as llama_runtime
from shared.engines.llama_cpp.runtime import GGUFWeights, LlamaModel, Segment, probe_amx
from tests.support.tiny_gguf import save_tiny_gguf

IDS = [2, 3, 4, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def gguf(tiny_models: dict[str, Path]) -> Path:
    return save_tiny_gguf(tiny_models["llama-target"])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "amx.json"
    monkeypatch.setenv("SPECDEC_LLAMA_AMX_CACHE", str(path))
    monkeypatch.delenv("SPECDEC_LLAMA_AMX", raising=False)
    return path


def on_an_amx_machine(monkeypatch: pytest.MonkeyPatch, probe_script: str) -> None:
    """As on a machine whose llama.cpp offers the AMX layout, with ``probe_script`` as the
    child's program (the tiny float32 file itself never goes into it)."""
    monkeypatch.setattr(llama_runtime, "extra_buffer_types", lambda: ["AMX", "CPU_REPACK"])
    monkeypatch.setattr(llama_runtime, "_AMX_PROBE", probe_script)


def no_probe(*_args: object) -> str:
    raise AssertionError("probed again: the recorded answer was not used")


def logits(weights: GGUFWeights) -> np.ndarray:
    [rows] = LlamaModel(weights, n_seqs=1, seq_tokens=32, threads=1).decode(
        [Segment(0, 0, IDS, 0)])
    assert rows is not None
    return rows


def test_the_real_probe_runs_in_a_child(gguf: Path, tmp_path: Path) -> None:
    """A float32 file puts nothing into the AMX layout, whatever the machine; a file llama.cpp
    cannot load says so instead of passing for an AMX failure."""
    assert probe_amx(str(gguf), 1) == "no-amx"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    assert probe_amx(str(broken), 1) == "not-loaded"


def test_extra_layouts_are_named() -> None:
    names = llama_runtime.extra_buffer_types()
    assert all(isinstance(name, str) and name for name in names)


def test_a_crashing_probe_keeps_the_weights_plain_and_is_remembered(
        gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_LLAMA_AMX", "1")
    reference = logits(GGUFWeights(str(gguf)))  # llama.cpp's default layouts
    monkeypatch.delenv("SPECDEC_LLAMA_AMX")
    on_an_amx_machine(monkeypatch, "import os, signal\nprint('amx', flush=True)\n"
                                   "os.kill(os.getpid(), signal.SIGSEGV)\n")
    weights = GGUFWeights(str(gguf))
    assert weights.extra_layouts is False
    assert np.allclose(logits(weights), reference, atol=1e-4)  # the same model, plain layout
    assert list(json.loads(cache.read_text()).values()) == [False]  # per machine
    monkeypatch.setattr(llama_runtime, "probe_amx", no_probe)
    assert GGUFWeights(str(gguf)).extra_layouts is False


def test_a_probe_that_runs_keeps_the_layouts(gguf: Path, cache: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    on_an_amx_machine(monkeypatch, "print('amx', flush=True)\nprint(0)\n")
    assert GGUFWeights(str(gguf)).extra_layouts is True
    assert list(json.loads(cache.read_text()).values()) == [True]
    monkeypatch.setattr(llama_runtime, "probe_amx", no_probe)
    assert GGUFWeights(str(gguf)).extra_layouts is True


def test_a_decode_error_or_a_hang_counts_as_failing(gguf: Path, cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    on_an_amx_machine(monkeypatch, "print('amx', flush=True)\nprint(-1)\n")
    assert probe_amx(str(gguf), 1) == "amx-failed"


def test_a_file_with_nothing_for_amx_is_remembered_per_file(
        gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_runtime, "extra_buffer_types", lambda: ["AMX", "CPU_REPACK"])
    assert GGUFWeights(str(gguf)).extra_layouts is True  # the real probe: "no-amx"
    recorded = json.loads(cache.read_text())
    assert list(recorded) == ["no-amx"] and len(recorded["no-amx"]) == 1
    monkeypatch.setattr(llama_runtime, "probe_amx", no_probe)
    assert llama_runtime.amx_works(str(gguf), 1) is None


@pytest.mark.parametrize(("setting", "layouts"), [("0", False), ("1", True)])
def test_the_setting_decides_without_a_probe(setting: str, layouts: bool, gguf: Path,
                                             cache: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_runtime, "extra_buffer_types", lambda: ["AMX"])
    monkeypatch.setattr(llama_runtime, "probe_amx", no_probe)
    monkeypatch.setenv("SPECDEC_LLAMA_AMX", setting)
    assert GGUFWeights(str(gguf)).extra_layouts is layouts
    assert not cache.exists()
