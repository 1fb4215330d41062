"""What was measured on this machine once and kept for later starts: small JSON files under
``$SPECDEC_HOME`` (``--dtype auto``'s choices, llama.cpp's AMX probe), keyed by what the
measurement depends on, starting with the CPU's name."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
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


def read_json(path: Path) -> dict[str, Any]:
    """The file's object; empty where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any], what: str) -> None:
    """Replace the file with ``data`` (written beside it first, so no reader sees half of
    it); where it cannot be written (a read-only home), ``what`` is measured again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot record %s in %s: %s", what, path, exc)
