"""A free loopback port, the one readiness poller, and a ``specdec-verifier`` subprocess.

  python -m verifier_service.launch wait-ready URL [TIMEOUT_S]   # exit 0 once URL/readyz is 200
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 120.0,
               path: str = "/readyz") -> None:
    """Poll ``url + path`` until it answers 200. Raises RuntimeError when ``timeout_s`` passes
    or ``proc`` (the server's process, when there is one) exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before it "
                               "was ready")
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready in {timeout_s:g} s")


def one_session(http: httpx.Client) -> None:
    """A verifier's basic round: create a session, verify one draft, delete it; AssertionError
    naming the call that did not answer as expected."""
    created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]})
    assert created.status_code == 200, f"create: {created.status_code} {created.text[:200]}"
    sid = created.json()["session_id"]
    ok = http.post(f"/v1/sessions/{sid}/verify", json={
        "position": 3, "last_token": 4, "draft_ids": [5], "log_uniforms": [-0.1],
        "final_uniform": 0.5})
    assert ok.status_code == 200, f"verify: {ok.status_code} {ok.text[:200]}"
    gone = http.delete(f"/v1/sessions/{sid}")
    assert gone.status_code == 204, f"delete: {gone.status_code}"


class VerifierProcess:
    """``specdec-verifier`` on a loopback port, ready when the context is entered.

        with VerifierProcess(["--model", path, "--dtype", "float32"]) as verifier:
            SpecDecClient(verifier.url, ...)
    """

    def __init__(self, args: list[str], port: int | None = None, threads: int = 1,
                 quiet: bool = True, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 300.0, log_path: Path | None = None) -> None:
        """``log_path``: the server's stdout and stderr go to this file (else: nowhere when
        ``quiet``, this process's otherwise)."""
        self.fixed_port = port is not None
        self.port = port or free_port()
        # The console script where the project is installed; else the module (a GPU machine
        # that has the source tree and carried wheels, but no install of this project).
        launcher = ([str(BIN / "specdec-verifier")] if (BIN / "specdec-verifier").exists()
                    else [sys.executable, "-m", "verifier_service.cli"])
        self.launcher, self.args, self.threads = launcher, args, threads
        self.prefix: list[str] = []  # e.g. ["taskset", "-c", "1"]
        self.quiet, self.ready_timeout_s, self.log_path = quiet, ready_timeout_s, log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cmd(self) -> list[str]:
        return [*self.prefix, *self.launcher, "--port", str(self.port), "--threads",
                str(self.threads), *self.args]

    def start(self, attempts: int = 3) -> VerifierProcess:
        """Start the server and wait until it is ready. A port picked here can be taken by
        another process's outgoing connection before the server binds it (uvicorn then exits
        with 3, startup failed): up to ``attempts`` tries on fresh ports."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError:
                startup_failed = self.proc is not None and self.proc.returncode == 3
                if self.fixed_port or not startup_failed or attempt == attempts - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> VerifierProcess:
        if not self.quiet:
            print(f"$ {' '.join(self.cmd)}", flush=True)
        output: Any = subprocess.DEVNULL if self.quiet else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it open
        self.proc = subprocess.Popen(self.cmd, stdout=output, stderr=subprocess.STDOUT
                                     if self.log_path is not None else output, env=self.env)
        if self.log_path is not None:
            output.close()  # the child has its own copy
        try:
            wait_ready(self.url, self.proc, self.ready_timeout_s)
        except RuntimeError:
            self.kill()
            raise
        return self

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM (the verifier drains and exits 0), then SIGKILL after ``grace_s``."""
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> VerifierProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "wait-ready":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        wait_ready(argv[1], timeout_s=float(argv[2]) if len(argv) > 2 else 120.0)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
