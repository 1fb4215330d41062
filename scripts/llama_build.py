"""Build llama-cpp-python (the ``[llama]`` extra) from source for this machine, less AMX.

llama.cpp compiles for the build machine's instructions (``-march=native``). On an x86 CPU that
reports Intel AMX this includes its AMX weight layout, and on the cloud VMs this project runs on
those kernels crash at the first multi-token decode (a segmentation fault at ``ldtilecfg`` in
``ggml_backend_amx_mul_mat``, as in llama.cpp issue 20824). llama.cpp offers its AMX layout
*instead of* its ``CPU_REPACK`` one, and it offers no runtime switch between them, so the
runtime's fallback (shared/engines/llama_cpp/runtime.py: the plain layout) loses the repacked
kernels too.
Built without AMX (``-mno-amx-*`` after ``-march=native``: GCC and clang keep an explicit ``-mno``
whatever the order), llama.cpp repacks into ``CPU_REPACK``. On the 2-core AMX machine of
docs/benchmarks.md that made a 1-token decode of the 1.5B Q4_K_M target 11% faster and a
17-token block 30% cheaper than the plain layout.

The wheel is built once per llama-cpp-python version and flag set, into
``$SPECDEC_HOME/llama-wheels/`` (pip's own wheel cache would reuse a wheel built with other
flags), and the ``llama-server`` peer of ``scripts.bench llama`` is built with the same flags.
It is also built without llamafile's kernels (``-DGGML_LLAMAFILE=OFF``), which the exact engine
needs (docs/design.md, "Exact greedy on llama.cpp"); on a Q4_K_M file they ran only float16
attention products. ``SPECDEC_LLAMA_BUILD_AMX=1`` keeps AMX (a machine where its kernels
work); ``CMAKE_ARGS`` set by the user is passed on (e.g. ``-DGGML_CUDA=on``).

The wheel is lean: the engine loads libllama and the ggml libraries, never llama.cpp's common
library (argument parsing, chat parsers; the largest library in the wheel) nor its multimodal one
(mtmd), which llama-cpp-python builds and ships by default. The build switches both off
(``-DLLAVA_BUILD=OFF``, and the sdist's forced ``LLAMA_BUILD_COMMON`` turned off in its
CMakeLists.txt), the same kernels in less time; the wheel's folder name is unchanged.

    python -m scripts.llama_build wheel PYTHON   # builds if missing, prints the wheel's path
    python -m scripts.llama_build cmake-args     # the CMake arguments, one per line

Standard library only (and ``shared.machine_cache``, which is too): the Makefile runs it from
the repository's root before the project is installed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from shared.machine_cache import specdec_home

LLAMA_CPP_PYTHON = "0.3.36"  # the [llama] extra's pin (pyproject.toml)
AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def compiler_flags() -> list[str]:
    """The C/C++ flags added to llama.cpp's own: AMX off on x86 unless asked to keep it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if os.environ.get("SPECDEC_LLAMA_BUILD_AMX") == "1":
        return []
    return list(AMX_OFF)


# llamafile's matrix kernels multiply two rows and more unlike llama.cpp's one-row dot product
# (float16 attention included), so with them a verify block cannot round like one-token steps:
# the exact engine (kernels="exact") needs a build without them.
EXACT = ("-DGGML_LLAMAFILE=OFF",)


def cmake_args() -> list[str]:
    flags = " ".join(compiler_flags())
    ours = [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"] if flags else []
    return [*ours, *EXACT, *shlex.split(os.environ.get("CMAKE_ARGS", ""))]


def build_tag() -> str:
    """Names the flag set in the cache's folder names, so a change of flags builds anew."""
    extra = os.environ.get("CMAKE_ARGS", "").strip()
    tag = ("noamx" if compiler_flags() else "native") + "-nollamafile"
    if extra:
        tag += "-" + hashlib.sha256(extra.encode()).hexdigest()[:10]
    return tag


# llama-cpp-python's CMakeLists.txt forces the common library on; nothing it installs that the
# engine loads needs it once mtmd is off.
COMMON_FORCED = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
LEAN = ("-DLLAVA_BUILD=OFF",)


def unpack_sdist(python: str, folder: Path) -> Path:
    """The pinned sdist (downloaded into ``folder`` unless it is there), unpacked in ``folder``:
    the source folder. The wheel and the benchmark's ``llama-server`` are built from it."""
    sdist = folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        # --no-binary for this package alone: ":all:" would also build its build backend's
        # own requirements from source (ninja's among them: minutes) just to read its metadata.
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary",
                        "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d",
                        str(folder)],
                       check=True, stdout=sys.stderr)
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+ (Debian 12's 3.11.2 lacks it)
            archive.extractall(folder, filter="data")
        else:
            archive.extractall(folder)  # noqa: S202 - the pinned sdist from the index
    return folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"


def lean_source(python: str, scratch: Path) -> Path:
    """The pinned sdist, unpacked in ``scratch``, with the common library off."""
    source = unpack_sdist(python, scratch)
    cmake = source / "CMakeLists.txt"
    text = cmake.read_text()
    if text.count(COMMON_FORCED) != 1:
        raise SystemExit(f"{cmake} no longer forces the common library as expected: update "
                         "scripts/llama_build.py for this llama-cpp-python")
    cmake.write_text(text.replace(COMMON_FORCED, COMMON_FORCED.replace(" ON ", " OFF ")))
    return source


def wheel_dir() -> Path:
    return specdec_home() / "llama-wheels" / f"{LLAMA_CPP_PYTHON}-{build_tag()}"


def build_wheel(python: str) -> Path:
    """The wheel for this machine, built with ``python``'s pip the first time (about 8 minutes
    on 2 cores)."""
    folder = wheel_dir()
    found = sorted(folder.glob("llama_cpp_python-*.whl"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_ARGS": shlex.join([*LEAN, *cmake_args()])}
    print(f"building llama-cpp-python {LLAMA_CPP_PYTHON} from source, lean (minutes on 2 "
          f"cores): CMAKE_ARGS={env['CMAKE_ARGS']}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        source = lean_source(python, Path(scratch))
        subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                        str(source), "-w", scratch], check=True, env=env, stdout=sys.stderr)
        built = sorted(Path(scratch).glob("llama_cpp_python-*.whl"))
        if not built:
            raise SystemExit(f"pip built no llama-cpp-python wheel in {scratch}")
        target = folder / built[-1].name
        shutil.move(str(built[-1]), target)  # whole, or not at all: the glob above trusts it
    return target


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "cmake-args":
        print("\n".join(cmake_args()))
        return 0
    if len(argv) == 2 and argv[0] == "wheel":
        print(build_wheel(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
