"""The w4a8 engine's kernel library: found without a compiler, loaded only where it can be
vouched for (shared/engines/w4a8/build.py).

A runtime with no compiler (the image's) serves on w4a8 when the library was built at install,
and on llama.cpp, saying why, when it was not; ``--engine w4a8`` then refuses in one line. A
library planted by another user, left writable by others, cut short, edited, or without the
kernels' symbols is never loaded. The control: the intact library passes every check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from shared.engines import resolve
from shared.engines.w4a8 import W4A8Backend
from shared.engines.w4a8.build import check_kept, find, key, load, user_dir
from shared.models.catalog import ModelSpecError
from tests.support.tiny_gguf import save_quantized_gguf
from verifier_service.launch import VerifierProcess

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_quantized_gguf(tmp_path_factory.mktemp("kernels") / "target", seed=0)


@pytest.fixture(scope="module")
def built() -> Path:
    """The library this checkout built (make install), found as the verifier finds it."""
    found, reasons = find()
    assert found is not None, reasons
    return found


def kept_copy(built: Path, folder: Path) -> Path:
    """``folder`` holding a copy of the library and its manifest, as an install leaves them."""
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    for suffix in (".so", ".json"):
        shutil.copy2(built.with_suffix(suffix), folder / f"w4a8-{key()}{suffix}")
    return folder


def no_compiler(tmp_path: Path, prebuilt: Path) -> dict[str, str]:
    """The environment of a runtime image: no compiler on PATH, an empty cache of its own."""
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    return {**env, "PATH": str(BIN), "SPECDEC_HOME": str(tmp_path / "home"),
            "SPECDEC_W4A8_KERNELS": str(prebuilt), "OMP_NUM_THREADS": "1"}


def info(url: str) -> dict[str, object]:
    response = httpx.get(f"{url}/v1/info", timeout=30)
    assert response.status_code == 200
    return dict(response.json())


@pytest.mark.slow  # two verifier processes start (about 4 s of CPU each)
def test_without_a_compiler_the_prebuilt_library_serves_and_without_it_llama_cpp_does(
        tiny: Path, built: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny), "--max-context", "256"]
    prebuilt = kept_copy(built, tmp_path / "prebuilt")
    with VerifierProcess(args, env=no_compiler(tmp_path, prebuilt)) as verifier:
        served = info(verifier.url)
    assert served["engine"] == "w4a8" and str(served["dtype"]).startswith("gguf w4a8"), served

    empty = tmp_path / "none"
    empty.mkdir()
    with VerifierProcess(args, env=no_compiler(tmp_path, empty)) as verifier:
        served = info(verifier.url)
    assert served["engine"] == "llama-cpp", served
    assert "w4a8 would compute this file, but the w4a8 kernels are not built here" in \
        str(served["engine_choice"]), served

    refused = subprocess.run([str(BIN / "specdec-verifier"), *args, "--engine", "w4a8"],
                             env=no_compiler(tmp_path, empty), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert "no C++ compiler" in last and "--engine llama-cpp" in last, refused.stderr


def test_without_a_compiler_or_a_library_auto_answers_no_instead_of_raising(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in no_compiler(tmp_path, tmp_path / "none").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CXX", raising=False)
    backend = W4A8Backend()
    assert backend.runs_gguf() is False
    assert resolve("auto", str(tiny), "cpu").name == "llama-cpp"
    assert "no C++ compiler" in backend.passed_over(str(tiny), "cpu")


def test_the_intact_library_passes(built: Path) -> None:
    assert check_kept(built.parent) == (built, "")
    assert load(built).w4a8_isa_count() >= 1


def flipped(data: bytes) -> bytes:
    """``data`` with one byte in the middle changed (the same size)."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]


PLANTS = {
    "writable by others": lambda lib, man: os.chmod(lib, 0o666),
    "another user's": lambda lib, man: os.chown(lib, 12345, 12345),
    "cut to 4 KiB": lambda lib, man: lib.write_bytes(lib.read_bytes()[:4096]),
    "edited in place": lambda lib, man: lib.write_bytes(flipped(lib.read_bytes())),
    "a link to elsewhere": lambda lib, man: (lib.unlink(), lib.symlink_to(man)),
    "no manifest": lambda lib, man: man.unlink(),
    "a folder writable by others": lambda lib, man: os.chmod(lib.parent, 0o777),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_or_damaged_library_is_never_loaded(plant: str, built: Path,
                                                      tmp_path: Path) -> None:
    if plant == "another user's" and os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    folder = kept_copy(built, tmp_path / "kept")
    library, manifest = folder / f"w4a8-{key()}.so", folder / f"w4a8-{key()}.json"
    PLANTS[plant](library, manifest)
    found, why = check_kept(folder)
    assert found is None and why and "\n" not in why, why


def test_a_library_without_the_kernels_symbols_is_a_one_line_refusal(tmp_path: Path) -> None:
    source = tmp_path / "empty.cpp"
    source.write_text('extern "C" int nothing() { return 0; }\n')
    library = tmp_path / "empty.so"
    subprocess.run(["g++", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    with pytest.raises(ModelSpecError, match="do not load") as error:
        load(library)
    assert "\n" not in str(error.value)


def test_the_users_cache_is_private(built: Path) -> None:
    assert built.parent in (user_dir(), Path(os.environ.get("SPECDEC_W4A8_KERNELS", "/none")),
                            Path(sys.prefix) / "share" / "specdec" / "kernels")
    assert not os.stat(built.parent).st_mode & 0o022
