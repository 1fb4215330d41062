"""``python -m tests.support.cli_runs``: several ``specdec`` CLI runs in one process, so that
the process start and the imports of torch and transformers are paid once, not once a run.

Reads one JSON list of arguments a line on standard input, and answers each with one JSON line:
``{"returncode": ..., "stdout": ..., "stderr": ...}`` (what the run printed, as text). For
runs whose output is checked; a run whose stderr must hold one line and nothing else belongs in
a process of its own (a library warning is printed once a process)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

from drafter_client.apps.cli import run

PREFIX = '{"returncode"'  # the answer lines (whatever else a library may print)
ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    for line in sys.stdin:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run(json.loads(line))
            except SystemExit as exc:  # argparse's own errors
                code = exc.code if isinstance(exc.code, int) else 2
        print(json.dumps({"returncode": code, "stdout": out.getvalue(),
                          "stderr": err.getvalue()}), flush=True)


def answers(stdout: str, runs: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """The runs' results from the runner's output."""
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith(PREFIX)]
    return [subprocess.CompletedProcess(args, r["returncode"], r["stdout"], r["stderr"])
            for args, r in zip(runs, results, strict=True)]


class CliRunner:
    """One runner process for a module's runs: ``runner(*args)`` is one ``specdec`` run."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.cli_runs"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return answers(line, [list(args)])[0]
        raise RuntimeError(f"the CLI runner exited with {self.proc.wait()}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    main()
