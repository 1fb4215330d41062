"""Fault injection against a real verifier process: kill -9 and restart mid-generation, SIGTERM
with calls in flight, a verifier gone for good (partial output, exit code 3), a wrong URL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from drafter_client import SpecDecClient
from drafter_client.transport import SpecDecError, VerifierUnavailable
from tests.support.fault_proxy import FaultProxy
from tests.support.waiting import wait_until
from verifier_service.launch import VerifierProcess, free_port

pytestmark = pytest.mark.faults
PROMPT = [2, 3, 4, 5]
BIN = Path(sys.executable).parent


def spawn(model: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    verifier = VerifierProcess(["--model", str(model), "--dtype", "float32", "--device", "cpu",
                                "--max-draft-tokens", "8", *extra], port=port).start()
    assert verifier.proc is not None
    return verifier.proc


class Verifiers:
    """The module's verifier process, on one port. A test gets the running one, or a fresh one
    where an earlier test stopped it; the kill -9 test leaves its restarted verifier to the
    tests after it (one process start instead of two)."""

    def __init__(self, model: Path) -> None:
        self.model, self.port = model, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def running(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = spawn(self.model, self.port)
        return self.proc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def verifiers(tiny_models: dict[str, Path]) -> Iterator[Verifiers]:
    started = Verifiers(tiny_models["gpt2-target"])
    yield started
    started.stop()


@pytest.fixture()
def verifier(verifiers: Verifiers) -> tuple[subprocess.Popen[bytes], int]:
    """A running verifier process and its port."""
    return verifiers.running(), verifiers.port


def test_kill9_and_restart_mid_generation(tiny_models: dict[str, Path],
                                          verifier: tuple[subprocess.Popen[bytes], int],
                                          verifiers: Verifiers) -> None:
    proc, port = verifier
    url = f"http://127.0.0.1:{port}"
    drafter = str(tiny_models["gpt2-drafter"])
    expected = SpecDecClient(url, drafter, dtype="float32").generate(
        PROMPT, num_draft_tokens=4, max_new_tokens=48).token_ids
    client = SpecDecClient(url, drafter, dtype="float32", retry_budget_s=120)
    restarted: list[subprocess.Popen[bytes]] = []
    restarting: list[threading.Thread] = []
    blocks = 0

    def crash(_: list[int]) -> None:
        nonlocal blocks
        blocks += 1
        if blocks == 3:  # kill -9, then bring a fresh verifier up on the same port
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            restarting.append(threading.Thread(target=lambda: restarted.append(
                spawn(tiny_models["gpt2-target"], port)), daemon=True))
            restarting[0].start()

    try:
        result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=48, on_tokens=crash)
    finally:
        for thread in restarting:
            thread.join(timeout=120)
        for p in restarted:  # the module's verifier from now on (stopped after its tests)
            verifiers.proc = p
    assert result.token_ids == expected
    assert result.metrics.retries >= 1  # connection refused while the new one started
    assert result.metrics.session_reopens == 1  # the new verifier knew nothing of the session


@pytest.fixture(scope="module")
def exact_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """The verifier arguments of a tiny target on each exact CPU engine: a Q4_K_M file on
    llama.cpp's exact kernels, a Qwen2 on int8."""
    from tests.support.tiny_gguf import save_quantized_gguf
    from tests.support.tiny_models import save_tiny_qwen2

    root = tmp_path_factory.mktemp("exact")
    gguf = save_quantized_gguf(root / "q4k", seed=0)
    qwen2 = save_tiny_qwen2(root / "qwen2", 256)
    common = ["--max-draft-tokens", "8", "--max-context", "256"]
    return {"llama-cpp": ["--model", str(gguf), "--engine", "llama-cpp", *common],
            "int8": ["--model", str(qwen2), "--engine", "int8", *common]}


def tokenizer_of(args: list[str]) -> str:
    model = Path(args[args.index("--model") + 1])
    return str(model.parent if model.suffix == ".gguf" else model)


@pytest.mark.slow  # a verifier process killed and started again
@pytest.mark.parametrize("engine", ["llama-cpp", "int8"])
def test_kill9_and_restart_on_the_exact_engines(engine: str,
                                                exact_targets: dict[str, list[str]]) -> None:
    """The same restart on each exact CPU engine, with greedy output equal to the target
    alone's: the new verifier reopens the session from the committed tokens, which llama.cpp
    writes in its steps' layout (``prompt_length``; the naive reopen as a negative control is
    tests/test_reopen_exact.py's, which loses the session every second call - one reopen in a
    generation parts from the target too rarely to be a control)."""
    args, port = exact_targets[engine], free_port()
    first = VerifierProcess(args, port=port).start()
    url = first.url
    client = SpecDecClient(url, "ngram", tokenizer=tokenizer_of(args), retry_budget_s=120)
    prompt = [int(t) for t in range(7, 90, 7)]
    alone = client.baseline(prompt, max_new_tokens=40).token_ids
    second = VerifierProcess(args, port=port)
    restarting: list[threading.Thread] = []

    def crash(_: list[int]) -> None:
        if not restarting:  # after the first block: kill -9, then a fresh one on the port
            assert first.proc is not None
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
            restarting.append(threading.Thread(target=second.start, daemon=True))
            restarting[0].start()

    try:
        result = client.generate(prompt, max_new_tokens=40, num_draft_tokens=3,
                                 on_tokens=crash)
    finally:
        for thread in restarting:
            thread.join(timeout=120)
        second.stop()
    assert result.token_ids == alone
    assert result.metrics.session_reopens == 1


@pytest.mark.slow  # waits out the client's retry budget
def test_verifier_gone_for_good_gives_partial_output(tiny_models: dict[str, Path],
                                                     verifier: tuple[subprocess.Popen[bytes],
                                                                     int]) -> None:
    _, port = verifier
    url = f"http://127.0.0.1:{port}"
    with FaultProxy(url, die_after=3) as proxy:
        client = SpecDecClient(proxy.url, str(tiny_models["gpt2-drafter"]), dtype="float32",
                               retry_budget_s=1.5)
        with pytest.raises(VerifierUnavailable) as err:
            client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=48)
    partial = err.value.partial
    assert partial is not None and len(partial.token_ids) >= 3  # three blocks were answered
    assert "\n" not in str(err.value) and "retry budget 1.5 s" in str(err.value)
    # The same through the CLI: the tokens so far on stdout (JSON), exit code 3.
    with FaultProxy(url, die_after=3) as proxy:
        cli = subprocess.run(
            [str(BIN / "specdec"), "generate", "--verifier-url", proxy.url, "--drafter",
             str(tiny_models["gpt2-drafter"]), "--dtype", "float32", "--prompt",
             "the cat sat on", "--max-new-tokens", "48", "--retry-budget-s", "1.5", "--json"],
            capture_output=True, text=True, timeout=120)
    assert cli.returncode == 3, cli.stderr
    out = orjson.loads(cli.stdout)
    assert out["partial"] is True and len(out["token_ids"]) >= 3
    errors = [line for line in cli.stderr.splitlines() if line.startswith("specdec: error")]
    assert len(errors) == 1 and "partial output" in errors[0]


def test_sigterm_finishes_calls_in_flight(verifier: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = verifier
    url = f"http://127.0.0.1:{port}"
    answers: list[tuple[int, int, float]] = []

    def generate() -> None:
        response = httpx.post(f"{url}/v1/generate", timeout=120, json={
            "prompt_ids": PROMPT, "max_new_tokens": 200, "stop_at_eos": False})
        answers.append((response.status_code, len(response.json().get("token_ids", [])),
                        time.monotonic()))

    def verify_calls() -> int:
        return int(httpx.get(f"{url}/v1/metrics").json()["verify_calls"])

    before = verify_calls()
    threads = [threading.Thread(target=generate) for _ in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: verify_calls() - before >= 30, interval_s=0.01, what="30 verify calls")
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    def refused() -> bool:  # no longer accepting
        try:
            httpx.get(f"{url}/healthz", timeout=2)
        except httpx.TransportError:
            return True
        return False

    wait_until(refused, timeout_s=10, what="the verifier refusing connections after SIGTERM")
    for t in threads:
        t.join()
    assert proc.wait(timeout=60) == 0
    assert [(status, n) for status, n, _ in answers] == [(200, 200)] * 6
    assert any(done > sent for _, _, done in answers)  # they really were in flight


def test_wrong_url_is_one_line_and_exit_code_2(tiny_models: dict[str, Path]) -> None:
    port = free_port()  # nothing listens there
    cli = subprocess.run(
        [str(BIN / "specdec"), "generate", "--verifier-url", f"http://127.0.0.1:{port}",
         "--drafter", "ngram", "--tokenizer", str(tiny_models["gpt2-target"]), "--prompt",
         "the cat", "--retry-budget-s", "2"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPECDEC_API_KEY": ""})
    assert cli.returncode == 2
    assert cli.stdout == ""
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec: error: cannot reach the verifier at")
    assert "retry budget 2 s" in lines[0]  # the budget it was given, not the default 60 s
    with pytest.raises(SpecDecError, match="cannot reach"):
        SpecDecClient("http://no-such-host.invalid:8000", "ngram",
                      tokenizer=str(tiny_models["gpt2-target"]))
