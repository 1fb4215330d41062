"""Load: 32 concurrent clients x 20 generations each against one verifier process.

Checks: no failed generation, greedy outputs equal the same prompt's output from a quiet
verifier, no session left behind, and the verifier's peak RSS (VmHWM) within its KV budget plus
a fixed allowance over its RSS once warm. Prints the figures.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from drafter_client import SpecDecClient
from verifier_service.launch import VerifierProcess

pytestmark = [pytest.mark.load, pytest.mark.slow]
CLIENTS, GENERATIONS, MAX_CONTEXT = 32, 20, 128
ALLOWANCE_BYTES = 256 << 20  # Python, torch and HTTP buffers beyond the preallocated KV pool


def rss_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.fixture(scope="module")
def loaded_verifier(tiny_models: dict[str, Path]) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                    str]]:
    verifier = VerifierProcess([
        "--model", str(tiny_models["gpt2-target"]), "--dtype", "float32", "--device", "cpu",
        "--max-context", str(MAX_CONTEXT), "--kv-budget-tokens", str(MAX_CONTEXT * CLIENTS),
        "--max-sessions", str(CLIENTS), "--max-draft-tokens", "8"])
    with verifier:
        assert verifier.proc is not None
        yield verifier.proc, verifier.url


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc for RSS")
def test_32_clients_x_20_generations(tiny_models: dict[str, Path],
                                     loaded_verifier: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = loaded_verifier
    tokenizer = str(tiny_models["gpt2-target"])
    prompts = [[2 + (i % 20), 3 + (i % 7), 4, 5 + (i % 11)] for i in range(CLIENTS)]
    warm = SpecDecClient(url, "ngram", tokenizer=tokenizer)
    expected = {tuple(p): warm.generate(p, max_new_tokens=24, num_draft_tokens=4).token_ids
                for p in prompts}
    warm_rss = rss_bytes(proc.pid, "VmRSS")
    pool_bytes = httpx.get(f"{url}/v1/metrics").json()["kv_pool_bytes"]
    failures: list[str] = []
    mismatches: list[int] = []
    done = [0] * CLIENTS

    def client_loop(i: int) -> None:
        try:
            client = SpecDecClient(url, "ngram" if i % 2 else "prompt-lookup",
                                   tokenizer=tokenizer)
            for _ in range(GENERATIONS):
                try:
                    result = client.generate(prompts[i], max_new_tokens=24, num_draft_tokens=4)
                except Exception as exc:  # noqa: BLE001 - counted, reported below
                    failures.append(f"client {i}: {exc}")
                    continue
                if result.token_ids != expected[tuple(prompts[i])]:
                    mismatches.append(i)
                done[i] += 1
        except Exception as exc:  # noqa: BLE001
            failures.append(f"client {i} setup: {exc}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics = httpx.get(f"{url}/v1/metrics").json()
    peak = rss_bytes(proc.pid, "VmHWM")
    print(f"\nload: {sum(done)} generations, {len(failures)} failed; verifier RSS warm "
          f"{warm_rss / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB, KV pool "
          f"{pool_bytes / 2**20:.1f} MiB; mean batch {metrics['mean_batch_size']}, "
          f"sessions left {metrics['sessions']}, 429s {metrics['rejected_queue_full']}")
    assert failures == []
    assert sum(done) == CLIENTS * GENERATIONS
    assert mismatches == []
    assert metrics["sessions"] == 0
    assert metrics["mean_batch_size"] > 1  # the clients really were served concurrently
    assert peak <= warm_rss + pool_bytes + ALLOWANCE_BYTES
