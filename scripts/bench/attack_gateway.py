"""``attack --gateway``: ``specdec serve`` under attack next to a normal client (see attack.py).

Starts a tiny verifier and a gateway process in front of it (n-gram drafter), then for
``--seconds`` at once: stalled bodies on ``/v1/completions``; threads posting bodies over the
gateway's body limit (413 expected) and bodies just under it whose prompt cannot fit the context
(400 expected, refused before tokenizing); threads opening long streams and hanging up after the
first chunk. A normal client asks for 8-token completions in a loop. Reports the gateway's RSS
(start, peak, end, and after the attack once idle), the attackers' answers by status, the
verifier's open sessions at the end (cut streams must not leave any) and the client's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.attack import Attack, percentiles_ms, report, rss_mib
from verifier_service.launch import BIN, VerifierProcess, free_port, wait_ready

BODY_LIMIT = 1 << 20  # the gateway's default --max-body-bytes


def start_gateway(verifier_url: str,
                  flags: tuple[str, ...] = ("--drafter", "ngram", "--max-concurrency", "8"),
                  log_path: Path | None = None, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """``specdec serve`` with these flags on a free port, ready; its output to ``log_path``
    (else nowhere); ``env`` added to this process's environment (its key:
    SPECDEC_SERVE_API_KEY, never a flag)."""
    port = free_port()
    launcher = ([str(BIN / "specdec")] if (BIN / "specdec").exists()
                else [sys.executable, "-m", "drafter_client.apps.cli"])
    out = log_path.open("wb") if log_path is not None else subprocess.DEVNULL
    proc = subprocess.Popen([*launcher, "serve", "--verifier-url", verifier_url, "--port",
                             str(port), *flags], stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, 120.0, path="/health")
    return proc, url


def large_sender(url: str, model: str, stop: threading.Event, size_mib: float,
                 statuses: Counter[str]) -> None:
    head = b'{"model": "' + model.encode() + b'", "prompt": "'
    over = head + b"a " * int(size_mib * (1 << 20) / 2) + b'"}'
    under = head + b"a " * ((BODY_LIMIT - len(head) - 8) // 2) + b'"}'
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            for name, body in (("over", over), ("under", under)):
                try:
                    answer = http.post("/v1/completions", content=body,
                                       headers={"content-type": "application/json"})
                    statuses[f"{name} {answer.status_code}"] += 1
                except httpx.HTTPError as exc:
                    statuses[f"{name} {type(exc).__name__}"] += 1


def stream_cutter(url: str, model: str, stop: threading.Event, statuses: Counter[str]) -> None:
    body = {"model": model, "prompt": "the cat sat on the mat", "max_tokens": 200,
            "temperature": 1.0, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            try:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    statuses[f"stream {response.status_code}"] += 1
                    next(response.iter_lines())
            except (httpx.HTTPError, StopIteration) as exc:
                statuses[f"stream {type(exc).__name__}"] += 1


def normal_client(url: str, model: str, stop: threading.Event, latencies: list[float],
                  errors: list[str]) -> None:
    body = {"model": model, "prompt": "the cat", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                answer = http.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text[:200]
                latencies.append(time.perf_counter() - started)
            except (httpx.HTTPError, AssertionError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.1)


def quiet_latencies(url: str, model: str, seconds: float) -> list[float]:
    """The normal client alone, for its latency without the attack."""
    stop, latencies, errors = threading.Event(), [], []  # type: ignore[var-annotated]
    thread = threading.Thread(target=normal_client, args=(url, model, stop, latencies, errors))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return latencies


def run_gateway(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.tiny_models import save_tiny

    target = str(save_tiny(Path(tempfile.mkdtemp()) / "tiny", "llama", 64, seed=3))
    verifier = VerifierProcess(["--model", target, "--dtype", "float32"],
                               threads=args.threads).start()
    gateway, url = start_gateway(verifier.url)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        quiet = quiet_latencies(url, model, min(10.0, args.seconds / 2))
        rss = [rss_mib(gateway.pid)]
        stop, latencies, errors = threading.Event(), [], []  # type: ignore[var-annotated]
        statuses: Counter[str] = Counter()
        threads = [threading.Thread(target=normal_client,
                                    args=(url, model, stop, latencies, errors))]
        threads += [threading.Thread(target=large_sender,
                                     args=(url, model, stop, args.large_mib, statuses))
                    for _ in range(args.large_senders)]
        threads += [threading.Thread(target=stream_cutter, args=(url, model, stop, statuses))
                    for _ in range(args.cut_streams)]
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(0.5):
                rss.append(rss_mib(gateway.pid))

        sampler = threading.Thread(target=sample)
        for thread in [*threads, sampler]:
            thread.start()
        port = int(url.rsplit(":", 1)[1])
        attack = Attack("127.0.0.1", port, 0, 0, args.stalled, args.body_kib,
                        path="/v1/completions")
        still_open = asyncio.run(attack.run(args.seconds))
        stop.set()
        for thread in threads:
            thread.join()
        time.sleep(3.0)  # generations of cut streams end at their next block
        sampler_stop.set()
        sampler.join()
        rss_idle = rss_mib(gateway.pid)
        sessions = httpx.get(verifier.url + "/v1/metrics").json()["sessions"]
    finally:
        gateway.terminate()
        gateway.wait(30)
        verifier.stop()
    row = {
        "label": args.label or "gateway", "rss_start_mib": round(rss[0], 1),
        "rss_peak_mib": round(max(rss), 1), "rss_idle_after_mib": round(rss_idle, 1),
        "open_stalled": still_open["stalled"], "verifier_sessions_after": sessions,
        **{k: v for k, v in sorted(statuses.items())},
        "client_calls": len(latencies), "client_errors": len(errors),
        **{f"client_{k}": v for k, v in percentiles_ms(latencies).items()},
        **{f"quiet_{k}": v for k, v in percentiles_ms(quiet).items()},
    }
    return report(args, row, errors, drafter="ngram", max_new_tokens=8)
