"""scripts/llama_build.py: llama-cpp-python built without llama.cpp's AMX kernels on x86."""

from __future__ import annotations

import platform
import shlex
import subprocess
from pathlib import Path

import pytest

from scripts import llama_build
from shared.engines.llama_cpp.runtime import extra_buffer_types


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.delenv("SPECDEC_LLAMA_BUILD_AMX", raising=False)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    return tmp_path


def test_amx_off_on_x86_only(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    args = llama_build.cmake_args()
    assert args == ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                    "-DGGML_LLAMAFILE=OFF"]
    assert llama_build.build_tag() == "noamx-nollamafile"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert llama_build.cmake_args() == ["-DGGML_LLAMAFILE=OFF"]
    assert llama_build.build_tag() == "native-nollamafile"


def test_amx_kept_when_asked_and_user_args_passed_on(clean_env: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("SPECDEC_LLAMA_BUILD_AMX", "1")
    assert llama_build.cmake_args() == ["-DGGML_LLAMAFILE=OFF"]
    monkeypatch.delenv("SPECDEC_LLAMA_BUILD_AMX")
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    assert llama_build.cmake_args()[-1] == "-DGGML_CUDA=on"
    tag = llama_build.build_tag()
    assert tag.startswith("noamx-nollamafile-")  # its own wheel folder
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_BLAS=on")
    assert llama_build.build_tag() != tag


def test_wheel_built_once_with_the_flags(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_pip(cmd: list[str], check: bool, env: dict[str, str], stdout: object) -> None:
        calls.append((cmd, env))
        out = Path(cmd[cmd.index("-w") + 1])
        (out / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    wheel = llama_build.build_wheel("python")
    assert wheel.exists()
    assert wheel.parent == clean_env / "llama-wheels" / "0.3.36-noamx-nollamafile"
    cmd, env = calls[0]
    assert "--no-cache-dir" in cmd  # pip's cache holds wheels built with other flags
    # scikit-build-core splits CMAKE_ARGS with shlex: each -D value stays whole
    assert shlex.split(env["CMAKE_ARGS"]) == llama_build.cmake_args()
    assert llama_build.build_wheel("python") == wheel and len(calls) == 1


def test_installed_llama_cpp_has_no_amx_layout() -> None:
    """What `make install` built: on x86 llama.cpp repacks into CPU_REPACK, never AMX."""
    if not llama_build.compiler_flags():
        pytest.skip("AMX is kept on this machine or it is not x86")
    assert "AMX" not in extra_buffer_types()
