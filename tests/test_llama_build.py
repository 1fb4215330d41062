"""scripts/llama_build.py: llama-cpp-python built without llama.cpp's AMX kernels on x86."""

from __future__ import annotations

import io
import platform
import shlex
import subprocess
import tarfile
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
    built_from: list[str] = []

    def fake_pip(cmd: list[str], check: bool, stdout: object,
                 env: dict[str, str] | None = None) -> None:
        calls.append((cmd, env or {}))
        if cmd[3] == "download":  # an sdist whose CMakeLists.txt forces the common library
            out = Path(cmd[cmd.index("-d") + 1])
            fake_sdist(out / "llama_cpp_python-0.3.36.tar.gz", llama_build.COMMON_FORCED)
            return
        source = Path(cmd[cmd.index("-w") - 1])
        built_from.append((source / "CMakeLists.txt").read_text())
        out = Path(cmd[cmd.index("-w") + 1])
        (out / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    wheel = llama_build.build_wheel("python")
    assert wheel.exists()
    assert wheel.parent == clean_env / "llama-wheels" / "0.3.36-noamx-nollamafile"
    cmd, env = calls[1]
    assert "--no-cache-dir" in cmd  # pip's cache holds wheels built with other flags
    # scikit-build-core splits CMAKE_ARGS with shlex: each -D value stays whole
    assert shlex.split(env["CMAKE_ARGS"]) == ["-DLLAVA_BUILD=OFF", *llama_build.cmake_args()]
    # lean: built from the sdist with the common library off
    assert built_from == ['x\nset(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common '
                          'library" FORCE)\ny\n']
    assert llama_build.build_wheel("python") == wheel and len(calls) == 2


def fake_sdist(path: Path, line: str) -> None:
    body = f"x\n{line}\ny\n".encode()
    info = tarfile.TarInfo("llama_cpp_python-0.3.36/CMakeLists.txt")
    info.size = len(body)
    with tarfile.open(path, "w:gz") as archive:
        archive.addfile(info, io.BytesIO(body))


def test_an_sdist_that_no_longer_forces_common_stops_the_build(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lean patch must find its line: a changed CMakeLists.txt stops with a message
    instead of building the full library silently."""
    def fake_pip(cmd: list[str], check: bool, stdout: object) -> None:
        fake_sdist(Path(cmd[cmd.index("-d") + 1]) / "llama_cpp_python-0.3.36.tar.gz",
                   "set(LLAMA_BUILD_COMMON ON)")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(SystemExit, match="no longer forces the common library"):
        llama_build.lean_source("python", clean_env)


def test_installed_llama_cpp_has_no_amx_layout() -> None:
    """What `make install` built: on x86 llama.cpp repacks into CPU_REPACK, never AMX."""
    if not llama_build.compiler_flags():
        pytest.skip("AMX is kept on this machine or it is not x86")
    assert "AMX" not in extra_buffer_types()


def test_the_wheel_is_the_llama_extras_pin() -> None:
    """`make demo` installs the built wheel as the [llama] extra: the two versions are one."""
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert extras["llama"] == [f"llama-cpp-python=={llama_build.LLAMA_CPP_PYTHON}"]
