"""Helpers the demo and the benchmarks share: a verifier subprocess, a free port, JSON results."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_verifier(model: str, port: int, threads: int, extra_args: tuple[str, ...] = (),
                   quiet: bool = False) -> subprocess.Popen[bytes]:
    """Start `specdec-verifier` on loopback and wait until /readyz answers."""
    cmd = [str(Path(sys.executable).parent / "specdec-verifier"), "--model", model,
           "--port", str(port), "--threads", str(threads), *extra_args]
    if not quiet:
        print(f"$ {' '.join(cmd)}", flush=True)
    output = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, stdout=output, stderr=output)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the verifier did not become ready" + ("" if quiet else "; see its log"))


def stop_verifier(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def write_results(out: str, payload: dict[str, Any]) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
