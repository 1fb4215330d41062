"""The servers ``attack --classes`` attacks (scripts/bench/attack_classes.py), and what every
class shares: the keys, a prompt of n tokens, the ``/health`` probe.

Verifier A: the llama.cpp engine on a tiny GGUF target (context 256, 4 KV slots, no keys). The
gateway in front of it: a GGUF drafter on llama.cpp, ``--overlap``, under an API key. Verifier
B: the transformers engine with two API keys, 2 sessions a key, 4 KV slots, and a verify-cost
file (``SPECDEC_VERIFY_COSTS``) truncated before it starts - the ``hostile cost file`` class
reads what it made of that.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.attack import rss_mib
from scripts.bench.attack_gateway import start_gateway
from verifier_service.launch import VerifierProcess

KEY = "attack-gateway-key"
AUTH = {"authorization": f"Bearer {KEY}"}
VERIFIER_KEYS = ("attack-key-a-0123", "attack-key-b-4567")
CONTEXT = 256  # the tiny models' trained context: the GGUF drafter's n_ctx
HEAD_TIMEOUT_S = 2.0
# Verifier B's cost file as a crash halfway through a write leaves it: not JSON.
TRUNCATED_COSTS = '{"transformers|a model|float32": [[0, 1.5], [1, 1.'

# What a class returns: the answers by status, its checks (name -> held), its figures.
Outcome = tuple[Counter[str], dict[str, bool], dict[str, Any]]


class Servers:
    """The three servers and their logs (for tracebacks)."""

    def __init__(self, root: Path) -> None:
        from tests.support.tiny_gguf import save_tiny_gguf
        from tests.support.tiny_models import save_perturbed, save_tiny

        self.root = root
        self.target_dir = save_tiny(root / "target", "llama", 64, seed=3, init_range=0.3)
        drafter_dir = save_perturbed(self.target_dir, root / "drafter", 0.01, seed=11)
        self.target_gguf, self.drafter_gguf = (save_tiny_gguf(self.target_dir),
                                               save_tiny_gguf(drafter_dir))
        self.logs = {name: root / f"{name}.log" for name in ("verifier", "keyed", "gateway")}
        self.verifier = VerifierProcess(
            ["--model", str(self.target_gguf), "--engine", "llama-cpp", "--max-context",
             str(CONTEXT), "--kv-budget-tokens", str(4 * CONTEXT), "--max-draft-tokens", "8"],
            log_path=self.logs["verifier"])
        self.costs = root / "verify-costs.json"
        self.costs.write_text(TRUNCATED_COSTS)
        self.keyed = VerifierProcess(
            ["--model", str(self.target_dir), "--dtype", "float32", "--max-context", "64",
             "--kv-budget-tokens", "256"], log_path=self.logs["keyed"],
            env={"SPECDEC_API_KEYS": ",".join(VERIFIER_KEYS),
                 "SPECDEC_MAX_SESSIONS_PER_KEY": "2", "SPECDEC_VERIFY_COSTS": str(self.costs)})
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_url = ""
        self.quick = False
        self.closers: list[Callable[[], None]] = []  # servers a class started, stopped at exit
        self.shared: dict[str, Any] = {}  # what classes keep for each other (round 5's pair)

    def __enter__(self) -> Servers:
        self.verifier.start()
        self.keyed.start()
        self.gateway, self.gateway_url = start_gateway(self.verifier.url, (
            "--drafter", str(self.drafter_gguf), "--drafter-engine", "llama-cpp", "--overlap",
            "--no-lookup", "--tokenizer", str(self.target_dir), "--header-timeout-s",
            str(HEAD_TIMEOUT_S), "--threads", "1"), self.logs["gateway"],
            env={"SPECDEC_SERVE_API_KEY": KEY})
        return self

    def __exit__(self, *exc: object) -> None:
        for close in reversed(self.closers):
            close()
        if self.gateway is not None:
            self.gateway.terminate()
            self.gateway.wait(30)
        self.verifier.stop()
        self.keyed.stop()

    def tracebacks(self) -> int:
        return sum(path.read_text(errors="replace").count("Traceback")
                   for path in self.logs.values() if path.exists())

    def rss(self) -> dict[str, float]:
        pids = {"verifier": self.verifier.proc, "gateway": self.gateway}
        return {f"rss_{name}_mib": round(rss_mib(proc.pid), 1)
                for name, proc in pids.items() if proc is not None}

    def counters(self) -> dict[str, Any]:
        """Verifier A's ``/v1/metrics``."""
        return dict(httpx.get(self.verifier.url + "/v1/metrics").json())

    def gateway_busy(self) -> int:
        """Generations the gateway runs or queues (its Prometheus gauges)."""
        text = httpx.get(self.gateway_url + "/metrics", headers=AUTH).text
        return sum(int(float(line.split()[-1])) for line in text.splitlines()
                   if line.startswith(("specdec_gateway_requests_running ",
                                       "specdec_gateway_requests_waiting ")))

    def verify_calls(self) -> int:
        return int(self.counters()["verify_calls"])

    def greedy(self) -> tuple[str, list[int]]:
        """The gateway's and verifier A's greedy answers to fixed requests."""
        text = httpx.post(self.gateway_url + "/v1/completions", headers=AUTH, timeout=60, json={
            "model": self.model, "prompt": "the cat sat on the", "max_tokens": 16,
            "temperature": 0}).json()["choices"][0]["text"]
        ids = httpx.post(self.verifier.url + "/v1/generate", timeout=60, json={
            "prompt_ids": [2, 3, 4, 5], "max_new_tokens": 16}).json()["token_ids"]
        return text, ids

    @property
    def model(self) -> str:
        return str(httpx.get(self.gateway_url + "/v1/models", headers=AUTH).json()["data"][0]["id"])


def words(n: int) -> str:
    """A prompt of ``n`` tokens (the tiny tokenizer has a token a word)."""
    return " ".join((["the", "cat", "sat", "on"] * (n // 4 + 1))[:n])


# /health timed from a process of its own: in this one the senders' threads (building and
# encoding 49 KB bodies) would hold the GIL and be timed as the server's wait
PROBE = """
import json, sys, time
import httpx
url, seconds = sys.argv[1], float(sys.argv[2])
waits = []
with httpx.Client(timeout=60) as probe:
    probe.get(url + "/health")  # connected before the clock starts
    ends = time.perf_counter() + seconds
    while time.perf_counter() < ends:
        started = time.perf_counter()
        probe.get(url + "/health")
        waits.append(time.perf_counter() - started)
        time.sleep(0.02)
print(json.dumps(waits))
"""


def health_waits(url: str, seconds: float) -> list[float]:
    """How long the gateway's ``/health`` took to answer, probed every 20 ms for ``seconds``
    by a child process (see PROBE)."""
    done = subprocess.run([sys.executable, "-c", PROBE, url, str(seconds)], check=True,
                          capture_output=True, text=True, timeout=seconds + 120)
    return [float(w) for w in json.loads(done.stdout)]


def flood_while_probing(url: str, body: bytes, headers: dict[str, str], senders: int,
                        probe_url: str, seconds: float) -> tuple[Counter[str], list[float]]:
    """``senders`` threads post ``body`` to ``url`` back to back while ``probe_url``'s
    ``/health`` is timed for ``seconds``: the answers by status, and the probes' waits. Every
    client is made before the clock starts (see :func:`health_waits`)."""
    statuses: Counter[str] = Counter()
    clients = [httpx.Client(timeout=120) for _ in range(senders)]
    stop, counting = threading.Event(), threading.Lock()

    def send(client: httpx.Client) -> None:
        while not stop.is_set():
            answer = client.post(url, headers=headers, content=body)
            with counting:  # hundreds of increments from many threads: none may be lost
                statuses[str(answer.status_code)] += 1

    threads = [threading.Thread(target=send, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    waits = health_waits(probe_url, seconds)
    stop.set()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    return statuses, waits


def hang_ups(s: Servers, extra: dict[str, Any], per_client: int = 2,
             clients: int = 12) -> Outcome:
    """Non-streaming chats without max_tokens (``extra`` added to their bodies) whose clients
    hang up after 0.3 s; then the verify calls verifier A makes until it goes quiet, at most
    ``per_client`` a client."""
    statuses: Counter[str] = Counter()

    def chat() -> None:
        try:
            answer = httpx.post(s.gateway_url + "/v1/chat/completions", headers=AUTH,
                                timeout=0.3, json={"model": s.model, "messages": [
                                    {"role": "user", "content": "the cat sat on"}],
                                    "temperature": 1.0, **extra})
            statuses[str(answer.status_code)] += 1
        except httpx.TimeoutException:
            statuses["hung up"] += 1

    threads = [threading.Thread(target=chat) for _ in range(clients)]
    start = s.verify_calls()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    connected = s.verify_calls() - start  # the generations were running when the clients left
    # Each generation could run to the context's end (about 240 tokens); a hang-up must end
    # it within a block. Wait until the gateway runs and queues no generation (a chat that
    # waited for a worker starts after its client left), then until the verifier goes quiet
    # (no verify call for 0.5 s).
    hung_up, before = time.perf_counter(), s.verify_calls()
    while s.gateway_busy() and time.perf_counter() - hung_up < 10:
        time.sleep(0.05)
    idle_after = time.perf_counter() - hung_up
    last, last_change = s.verify_calls(), time.perf_counter()
    while time.perf_counter() - last_change < 0.5 and time.perf_counter() - hung_up < 10:
        time.sleep(0.05)
        if (now := s.verify_calls()) != last:
            last, last_change = now, time.perf_counter()
    quiet_after = last_change - hung_up
    # Counted, not timed: a generation left running would make a verify call a block to the
    # end of the context.
    after = last - before
    return statuses, {
        f"at most {per_client} verify calls a client after the hang-ups":
            after <= per_client * clients,
        "generating when they left": connected > 0,
        "the gateway idle again": not s.gateway_busy()}, {
        "verify_calls_while_connected": connected, "verify_calls_after": after,
        "gateway_idle_after_s": round(idle_after, 2), "quiet_after_s": round(quiet_after, 2)}
