"""What was measured on this machine once and kept for later starts: small JSON files under
``$SPECDEC_HOME`` (the verify costs and auto's records of them, ``--dtype fastest``'s choices,
llama.cpp's AMX probe), keyed by what the measurement depends on, starting with the CPU's name.

They are data, not trust: anyone who can write ``$SPECDEC_HOME`` (a shared volume, a half-written
file after a crash) can put anything there, so each reader checks every entry it uses and
measures again where one is not what it wrote (:func:`read_json` says so in one warning line for
a file that is not a JSON object). Writers change a file under an exclusive lock on a sibling
``.lock`` file (:func:`update_json`: read, change, write, so two verifiers or compose replicas
starting together - each PID 1 in its container - lose nothing) and write it beside the file
under a name of their own (process, thread and random) before ``os.replace``, so a reader sees
the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import platform
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("specdec.machine")


def specdec_home() -> Path:
    """Where specdec keeps what it fetched, built or measured (``$SPECDEC_HOME``)."""
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def file_stamp(path: str | Path) -> str:
    """A file as a measurement of it depends on: where it is, its size and when it changed."""
    stat = Path(path).stat()
    return f"{Path(path).resolve()}|{stat.st_size}|{int(stat.st_mtime)}"


def read_json(path: Path, what: str = "", warn: bool = True) -> dict[str, Any]:
    """The file's object; empty where it is missing, and where it is unreadable, not JSON (a
    truncated write) or not an object, with one warning naming ``what`` it held."""
    said = what or "a cache"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or not JSON
        if warn:
            log.warning("ignoring %s (%s): %s; measuring again", path, said,
                        exc if isinstance(exc, OSError) else f"not JSON: {exc}")
        return {}
    if not isinstance(data, dict):
        if warn:
            log.warning("ignoring %s (%s): not a JSON object; measuring again", path, said)
        return {}
    return data


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (``fcntl.flock`` on ``<path>.lock`` beside it) for a
    read-modify-write: other processes and other threads of this one wait (each opens the
    lock file itself, and flock locks an open file, not a process)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing it releases the lock


def _replace(path: Path, data: dict[str, Any]) -> None:
    """``data`` written beside ``path`` under a name no other writer uses, then moved over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}"
                         f".{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "w") as out:
            # what others wrote stays as it was, NaN included: each reader checks its own
            out.write(json.dumps(data, indent=1, sort_keys=True))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def update_json(path: Path, change: Callable[[dict[str, Any]], None], what: str) -> None:
    """Read the file, ``change`` its object in place and write it back, under :func:`locked`:
    what another process or thread wrote meanwhile is kept (a file that is not an object is
    replaced: its reader has warned). Where it cannot be written (a read-only home), ``what`` is
    measured again next time."""
    try:
        with locked(path):
            data = read_json(path, what, warn=False)
            change(data)
            _replace(path, data)
    except (OSError, TypeError, ValueError) as exc:
        log.warning("cannot record %s in %s: %s", what, path, exc)

