"""Build and load the w4a8 engine's kernels (``kernels/``) once per machine.

The library is compiled with the system's g++ against PyTorch's own headers, so its threads are
PyTorch's (``at::parallel_for``: ``torch.set_num_threads`` sets them), and kept in
``$SPECDEC_HOME/kernels`` under a digest of the source, the flags, the compiler and PyTorch:
a changed source or a new PyTorch builds again, an unchanged one loads in milliseconds.
``make install`` builds it (``python -m shared.engines.w4a8.build``); the first load builds it
where that did not run. Concurrent loaders wait for one build (a lock file).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from shared.machine_cache import specdec_home
from shared.models.catalog import ModelSpecError

KERNELS = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNELS.glob("*.cpp"))
# -ffp-contract=off: no multiply-add fused unless the source writes one, so every path rounds
# alike; each ISA's code is compiled by target attributes, not -march, so one library holds
# every path and picks one at load (kernels/dispatch.cpp).
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
         "-fno-fast-math", "-Wall", "-Wno-unused-function"]

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "w4a8_isa_count": (_int, []),
    "w4a8_isa_name": (ctypes.c_char_p, [_int]),
    "w4a8_isa_available": (_int, [_int]),
    "w4a8_isa_packs": (_int, [_int]),
    "w4a8_isa": (_int, []),
    "w4a8_set_isa": (_int, [_int]),
    "w4a8_act_bytes": (_i64, [_i64]),
    "w4a8_quantize": (_int, [_ptr, _i64, _i64, _ptr, _i64]),
    "w4a8_matmul": (_int, [_int, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr,
                           _ptr, _i64, _i64]),
    "w4a8_packed_bytes": (_i64, [_int, _i64, _i64]),
    "w4a8_pack": (_int, [_int, _ptr, _i64, _i64, _i64, _ptr, _i64]),
    "w4a8_dequantize_rows": (_int, [_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr]),
    "w4a8_rms_norm": (_int, [_ptr, _ptr, _f32, _i64, _i64, _ptr]),
    "w4a8_silu_mul": (_int, [_ptr, _i64, _i64, _ptr]),
    "w4a8_attention": (_int, [_ptr, _i64, _ptr, _ptr, _int, _int, _int, _ptr, _ptr, _int,
                              _ptr, _ptr, _i64, _i64, _ptr]),
}


def _command(output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [os.environ.get("CXX", "g++"), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}", *map(str, SOURCES), "-o", str(output),
            f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]


def library_path() -> Path:
    """Where this source, built with these flags by this compiler for this PyTorch, is kept."""
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise ModelSpecError(f"the w4a8 engine builds its kernels with a C++ compiler; "
                             f"{compiler!r} did not run ({error}): install g++") from error
    digest = hashlib.sha256()
    sources = b"".join(path.name.encode() + path.read_bytes()
                       for path in sorted(KERNELS.glob("*.[ch]*")))
    for part in (sources, " ".join(FLAGS).encode(), version.encode(),
                 torch.__version__.encode(), str(Path(torch.__file__).parent).encode()):
        digest.update(part)
    return specdec_home() / "kernels" / f"w4a8-{digest.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """The compiled library, built here unless a good one is kept already."""
    output = library_path()
    if output.is_file() and not force:
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it now
        if output.is_file() and not force:
            return output
        scratch = output.with_name(f"{output.stem}.{os.getpid()}.tmp.so")
        result = subprocess.run(_command(scratch), capture_output=True, text=True)
        if result.returncode != 0:
            scratch.unlink(missing_ok=True)
            log = output.with_suffix(".log")
            log.write_text(" ".join(_command(scratch)) + "\n" + result.stderr)
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelSpecError(f"building the w4a8 kernels failed ({last}); the compiler's "
                                 f"output is in {log}; --engine llama-cpp serves GGUF files "
                                 "without them")
        os.replace(scratch, output)
    return output


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels, loaded (and built first where needed), their signatures declared."""
    try:
        lib = ctypes.CDLL(str(build()))
    except OSError:  # a file that does not load (truncated, another machine's): build again
        lib = ctypes.CDLL(str(build(force=True)))
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def paths() -> dict[str, bool]:
    """Every path the library holds, and whether this CPU runs it."""
    lib = library()
    return {lib.w4a8_isa_name(i).decode(): bool(lib.w4a8_isa_available(i))
            for i in range(lib.w4a8_isa_count())}


def packing() -> bool:
    """Whether a path this CPU runs reads packed panels (then matrices are packed at load)."""
    lib = library()
    return any(lib.w4a8_isa_available(i) and lib.w4a8_isa_packs(i)
               for i in range(lib.w4a8_isa_count()))


def isa_name() -> str:
    """The path in use (``avx512-vnni``, ``avx2``, ``portable``)."""
    lib = library()
    return str(lib.w4a8_isa_name(lib.w4a8_isa()).decode())


def choose_isa(name: str | None) -> str:
    """Use the path called ``name`` (None or "auto": the best this CPU runs); its name, or
    ModelSpecError naming the paths this CPU runs."""
    lib = library()
    if name in (None, "", "auto"):
        lib.w4a8_set_isa(-1)
        return isa_name()
    names = paths()
    if not names.get(name):
        runs = ", ".join(n for n, ok in names.items() if ok)
        why = "this CPU lacks it" if name in names else "no such path"
        raise ModelSpecError(f"w4a8 path {name!r}: {why}; this CPU runs {runs}")
    lib.w4a8_set_isa(list(names).index(name))
    return name


def main() -> None:
    """``python -m shared.engines.w4a8.build``: build (``--force``: again) and say where."""
    path = build(force="--force" in sys.argv)
    print(f"w4a8 kernels: {path} ({isa_name()} path on this CPU; this CPU runs "
          f"{', '.join(name for name, runs in paths().items() if runs)})")


if __name__ == "__main__":
    main()
