"""Build, find and load the w4a8 engine's kernels (``kernels/``): code the verifier runs, so
it loads only a library it can vouch for.

The library is compiled with g++ against PyTorch's own headers, so its threads are PyTorch's
(``at::parallel_for``: ``torch.set_num_threads`` sets them). It is kept under a key, a digest of
the sources, the flags and PyTorch (a changed source or a new PyTorch builds again), beside a
manifest that records its sha256 and the compiler that built it. It is looked for in two places:

* ``<prefix>/share/specdec/kernels`` (``sys.prefix``; ``SPECDEC_W4A8_KERNELS`` overrides it):
  built at install (``python -m shared.engines.w4a8.build --prebuilt``), as the image's build
  stage does, so a runtime with no compiler serves on w4a8;
* ``$SPECDEC_HOME/kernels``: built by this user at ``make install`` or at the first load.

A library is loaded only if it and its manifest are regular files owned by this user or root,
in a directory of the same owners, none of them writable by group or others, and its sha256 is
the manifest's: anything else (another user's file, loose modes, a short or edited file) is
never loaded. Where the user's own cache is not such a directory the build goes to a fresh
private one; where no library passes and no compiler is here, the engine is unavailable, and
``auto`` says why it chose another. Finding a library never runs the compiler. Concurrent
builders wait for one build (a lock file); a reader never takes a half-written file (the sha256).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from shared.machine_cache import specdec_home
from shared.models.catalog import ModelSpecError

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNELS.glob("*.cpp"))
# -ffp-contract=off: no multiply-add fused unless the source writes one, so every path rounds
# alike; each ISA's code is compiled by target attributes, not -march, so one library holds
# every path and picks one at load (kernels/dispatch.cpp).
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off",
         "-fno-fast-math", "-Wall", "-Wno-unused-function"]
# SPECDEC_W4A8_SANITIZE=1: a test build (``make test-asan``) with AddressSanitizer, UBSan and the
# C++ library's bounds assertions; kept under its own key, never the prebuilt library.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                  "-fno-omit-frame-pointer", "-D_GLIBCXX_ASSERTIONS"]


def flags() -> list[str]:
    """The compiler flags of the library this process uses."""
    return FLAGS + (SANITIZE_FLAGS if os.environ.get("SPECDEC_W4A8_SANITIZE") else [])

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "w4a8_isa_count": (_int, []),
    "w4a8_isa_name": (ctypes.c_char_p, [_int]),
    "w4a8_isa_available": (_int, [_int]),
    "w4a8_isa_packs": (_int, [_int]),
    "w4a8_isa": (_int, []),
    "w4a8_set_isa": (_int, [_int]),
    "w4a8_act_bytes": (_i64, [_i64]),
    "w4a8_layer": (_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]),
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


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def has_compiler() -> bool:
    return shutil.which(_compiler()) is not None


def _command(output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [_compiler(), *flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}", *map(str, SOURCES), "-o", str(output),
            f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]


def key() -> str:
    """What a library is kept under: the sources, the flags and this PyTorch (no compiler run)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in KERNELS.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (" ".join(flags()), torch.__version__, str(Path(torch.__file__).parent)):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def prebuilt_dir() -> Path:
    return Path(os.environ.get("SPECDEC_W4A8_KERNELS")
                or Path(sys.prefix) / "share" / "specdec" / "kernels")


def user_dir() -> Path:
    return specdec_home() / "kernels"


def _untrusted(path: Path, kind: int) -> str:
    """Why ``path`` is not a file (or folder, ``kind``) this process may run code from; "" if
    it is: not a link, owned by this user or root, writable by neither group nor others."""
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"{path}: {error.strerror}"
    if stat.S_IFMT(info.st_mode) != kind:
        return f"{path} is not a plain {'file' if kind == stat.S_IFREG else 'folder'}"
    if info.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to uid {info.st_uid}, not this user or root"
    if info.st_mode & 0o022:
        return f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_kept(folder: Path) -> tuple[Path | None, str]:
    """The library kept in ``folder`` for this key if it may be loaded, else None and why."""
    name = f"w4a8-{key()}"
    library, manifest = folder / f"{name}.so", folder / f"{name}.json"
    if not library.exists() and not manifest.exists():
        return None, f"{library} is not built"
    for path, kind in ((folder, stat.S_IFDIR), (library, stat.S_IFREG),
                       (manifest, stat.S_IFREG)):
        if why := _untrusted(path, kind):
            return None, why
    try:
        recorded = json.loads(manifest.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{manifest} is not a manifest ({error})"
    if _sha256(library) != recorded:
        return None, f"{library} is not the file its manifest records (sha256 differs)"
    return library, ""


def find() -> tuple[Path | None, list[str]]:
    """The first library that may be loaded (the prebuilt one, then this user's), and why
    each place did not give one."""
    reasons: list[str] = []
    for folder in (prebuilt_dir(), user_dir()):
        found, why = check_kept(folder)
        if found is not None:
            return found, reasons
        reasons.append(why)
    return None, reasons


def _private_folder(folder: Path, mode: int = 0o700) -> Path:
    """``folder``, made where missing (``mode``), if it is one this process may run code from;
    else a fresh private folder."""
    with contextlib.suppress(OSError):  # a read-only place: _untrusted says why below
        folder.mkdir(mode=mode, parents=True, exist_ok=True)
    if why := _untrusted(folder, stat.S_IFDIR):
        fresh = Path(tempfile.mkdtemp(prefix="specdec-kernels-"))
        log.warning("not building the w4a8 kernels in %s (%s): building them in %s", folder, why,
                    fresh)
        return fresh
    return folder


def build(folder: Path | None = None, force: bool = False) -> Path:
    """The compiled library in ``folder`` (this user's cache where None), built unless a good
    one is kept there already; its manifest beside it."""
    # the prebuilt folder is read by every user of the environment (the image's runtime user)
    target = _private_folder(folder or user_dir(), 0o755 if folder else 0o700)
    name = f"w4a8-{key()}"
    output, manifest = target / f"{name}.so", target / f"{name}.json"
    found, _ = check_kept(target)
    if found is not None and not force:
        return found
    if not has_compiler():
        raise ModelSpecError(f"the w4a8 kernels are not built in {target} and no C++ compiler "
                             f"({_compiler()!r}) is on PATH: install g++, or serve with "
                             "--engine llama-cpp")
    with open(target / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it now
        found, _ = check_kept(target)
        if found is not None and not force:
            return found
        scratch = target / f"{name}.{os.getpid()}.tmp.so"
        result = subprocess.run(_command(scratch), capture_output=True, text=True)
        if result.returncode != 0:
            scratch.unlink(missing_ok=True)
            failure = target / f"{name}.log"
            failure.write_text(" ".join(_command(scratch)) + "\n" + result.stderr)
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelSpecError(f"building the w4a8 kernels failed ({last}); the compiler's "
                                 f"output is in {failure}; --engine llama-cpp serves GGUF files "
                                 "without them")
        os.chmod(scratch, 0o755)
        version = subprocess.run([_compiler(), "--version"], capture_output=True,
                                 text=True).stdout.splitlines()[:1]
        record = {"sha256": _sha256(scratch), "key": key(), "torch": torch.__version__,
                  "compiler": version[0] if version else _compiler(), "flags": flags()}
        os.replace(scratch, output)
        written = target / f"{name}.{os.getpid()}.tmp.json"
        written.write_text(json.dumps(record, indent=1) + "\n")
        os.chmod(written, 0o644)
        os.replace(written, manifest)
    return output


def available() -> tuple[bool, str]:
    """Whether the engine can have its kernels here (a library that may be loaded, or a
    compiler to build one), and why not."""
    found, reasons = find()
    if found is not None or has_compiler():
        return True, ""
    return False, (f"the w4a8 kernels are not built here ({'; '.join(reasons)}) and no C++ "
                   f"compiler ({_compiler()!r}) is on PATH to build them")


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels, loaded (built first where none may be loaded and a compiler is here),
    their signatures declared; ModelSpecError in one line where neither."""
    found, _ = find()
    if found is None:
        ok, why = available()
        if not ok:
            raise ModelSpecError(f"{why}: install g++, or serve with --engine llama-cpp")
        found = build()
    return load(found)


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` (checked already), its signatures declared; ModelSpecError in
    one line where it does not load or lacks a kernel."""
    try:
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = argtypes
    except (OSError, AttributeError) as error:
        raise ModelSpecError(f"the w4a8 kernels in {path} do not load "
                             f"({str(error).splitlines()[0]}); delete it to build them again") \
            from None
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
    """``python -m shared.engines.w4a8.build [--force] [--prebuilt]``: build into this user's
    cache, or (``--prebuilt``) into ``<prefix>/share/specdec/kernels`` for every user of this
    environment, and say where and which path this CPU runs."""
    folder = prebuilt_dir() if "--prebuilt" in sys.argv else None
    path = build(folder, force="--force" in sys.argv)
    print(f"w4a8 kernels: {path} ({isa_name()} path on this CPU; this CPU runs "
          f"{', '.join(name for name, runs in paths().items() if runs)})")


if __name__ == "__main__":
    main()
