"""``attack``: a verifier, or the gateway in front of one, under attack next to a normal client.

Opens idle connections (nothing sent), slowloris connections (a request head that never ends,
one header line a second) and stalled bodies (most of a large body, then nothing), all at once,
and keeps them up for ``--seconds``. Meanwhile a normal client calls the verifier in a loop
(info, then create / verify / delete). Reports the verifier's peak RSS, how many attack
connections the verifier still holds open at the end, and the normal client's latency and
errors.

``--gateway`` attacks ``specdec serve`` (a process in front of a tiny verifier) instead: stalled
bodies on ``/v1/completions``, plus ``--large-senders`` threads posting bodies of
``--large-mib`` MiB (over the body limit) and of just under it (a prompt longer than the context),
and ``--cut-streams`` threads that open a long stream, read its first chunk and hang up; the
normal client asks for short completions. It reports the gateway's RSS, the attackers' answers
and the normal client's latency.

  python -m scripts.bench attack --target tiny
  python -m scripts.bench attack --verifier-url http://127.0.0.1:8000 --verifier-pid 1234
  python -m scripts.bench attack --gateway --seconds 20
  python -m scripts.bench attack --classes      # each hole of issue #42, one row a class
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.common import machine_record, markdown_table, write_json
from verifier_service.launch import VerifierProcess, one_session


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Attack:
    def __init__(self, host: str, port: int, idle: int, slowloris: int, stalled: int,
                 body_kib: int, path: str = "/v1/sessions") -> None:
        self.host, self.port, self.path = host, port, path.encode()
        self.counts = {"idle": idle, "slowloris": slowloris, "stalled": stalled}
        self.body = b"x" * (body_kib * 1024)
        self.writers: dict[str, list[asyncio.StreamWriter]] = {k: [] for k in self.counts}
        self.readers: dict[str, list[asyncio.StreamReader]] = {k: [] for k in self.counts}
        self.failed_to_connect = 0

    async def open(self, kind: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            self.failed_to_connect += 1
            return
        # the server's own Host: the gateway refuses any other (DNS rebinding) before the body
        host = f"Host: {self.host}:{self.port}\r\n".encode()
        if kind == "slowloris":
            writer.write(b"POST " + self.path + b" HTTP/1.1\r\n" + host)
        elif kind == "stalled":
            writer.write(b"POST " + self.path + b" HTTP/1.1\r\n" + host + b"content-type: "
                         b"application/json\r\ncontent-length: " +
                         str(len(self.body) + 16).encode() + b"\r\n\r\n" + self.body)
        with contextlib.suppress(OSError):
            await writer.drain()
        self.writers[kind].append(writer)
        self.readers[kind].append(reader)

    async def drip(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for writer in self.writers["slowloris"]:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write(b"X-Slow: 1\r\n")
            await asyncio.sleep(1.0)

    def still_open(self) -> dict[str, int]:
        """Attack connections the verifier has not closed (no EOF seen on them)."""
        return {kind: sum(1 for r in readers if not r.at_eof() and r.exception() is None)
                for kind, readers in self.readers.items()}

    async def run(self, seconds: float) -> dict[str, int]:
        await asyncio.gather(*(self.open(kind) for kind, n in self.counts.items()
                               for _ in range(n)))
        stop = asyncio.Event()
        drip = asyncio.create_task(self.drip(stop))
        pumps = [asyncio.create_task(self._pump(r)) for rs in self.readers.values() for r in rs]
        await asyncio.sleep(seconds)
        stop.set()
        await drip
        result = self.still_open()
        for task in pumps:
            task.cancel()
        for writers in self.writers.values():
            for writer in writers:
                writer.close()
        return result

    @staticmethod
    async def _pump(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass


def normal_client(url: str, stop: threading.Event, latencies: list[float],
                  errors: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                assert http.get("/v1/info").status_code == 200, "info"
                one_session(http)
                latencies.append(time.perf_counter() - started)
            except (httpx.HTTPError, AssertionError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="tiny", help="model spec, or 'tiny' (a random "
                        "tiny Llama; the attack is on connections, not the model)")
    parser.add_argument("--verifier-url", help="attack a running verifier instead")
    parser.add_argument("--verifier-pid", type=int, help="its process id, for RSS")
    parser.add_argument("--idle", type=int, default=500)
    parser.add_argument("--slowloris", type=int, default=300)
    parser.add_argument("--stalled", type=int, default=100)
    parser.add_argument("--body-kib", type=int, default=900)
    parser.add_argument("--seconds", type=float, default=35.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gateway", action="store_true",
                        help="attack `specdec serve` in front of a tiny verifier instead")
    parser.add_argument("--classes", action="store_true",
                        help="attack each hole of hardening rounds 3 to 5 in turn, on tiny "
                        "models, one row a class (scripts/bench/attack_classes.py)")
    parser.add_argument("--only", action="append", metavar="CLASS",
                        help="--classes: this class alone (again for more)")
    parser.add_argument("--quick", action="store_true",
                        help="--classes: the short run (the CLI class: two cases on `generate`)")
    parser.add_argument("--large-senders", type=int, default=2,
                        help="--gateway: threads posting large bodies")
    parser.add_argument("--large-mib", type=float, default=5.0,
                        help="--gateway: the size of the over-the-limit bodies")
    parser.add_argument("--cut-streams", type=int, default=4,
                        help="--gateway: threads opening streams and hanging up")
    parser.add_argument("--label", default="", help="a name for this run in the table")
    parser.add_argument("--out", default="bench_results/attack.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.classes:
        from scripts.bench.attack_classes import run_classes

        return run_classes(args)
    if args.gateway:
        from scripts.bench.attack_gateway import run_gateway

        return run_gateway(args)
    process = None
    url, pid = args.verifier_url, args.verifier_pid
    if url is None:
        target = args.target
        if target == "tiny":
            from tests.support.tiny_models import save_tiny

            target = str(save_tiny(Path(tempfile.mkdtemp()) / "tiny", "llama", 64, seed=3))
        process = VerifierProcess(["--model", target, "--dtype", "float32"],
                                  threads=args.threads).start()
        assert process.proc is not None
        url, pid = process.url, process.proc.pid
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        rss = [rss_mib(pid)] if pid else []
        stop, latencies, errors = threading.Event(), [], []  # type: ignore[var-annotated]
        client = threading.Thread(target=normal_client, args=(url, stop, latencies, errors))
        attack = Attack(host, int(port), args.idle, args.slowloris, args.stalled,
                        args.body_kib)
        sampler_stop = threading.Event()

        def sample() -> None:
            while pid and not sampler_stop.wait(0.5):
                rss.append(rss_mib(pid))

        sampler = threading.Thread(target=sample)
        client.start()
        sampler.start()
        still_open = asyncio.run(attack.run(args.seconds))
        stop.set()
        sampler_stop.set()
        client.join()
        sampler.join()
    finally:
        if process is not None:
            process.stop()
    row = {
        "label": args.label or url, "rss_start_mib": round(rss[0], 1) if rss else None,
        "rss_peak_mib": round(max(rss), 1) if rss else None,
        "rss_end_mib": round(rss[-1], 1) if rss else None,
        **{f"open_{kind}": n for kind, n in still_open.items()},
        "refused": attack.failed_to_connect, "client_calls": len(latencies),
        "client_errors": len(errors),
        **{f"client_{k}": v for k, v in percentiles_ms(latencies).items()},
    }
    return report(args, row, errors, drafter="-", max_new_tokens=0)


def percentiles_ms(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies) or [0.0]
    return {"p50_ms": round(1e3 * statistics.median(ordered), 1),
            "p95_ms": round(1e3 * ordered[min(int(0.95 * len(ordered)), len(ordered) - 1)], 1),
            "max_ms": round(1e3 * ordered[-1], 1)}


def report(args: argparse.Namespace, row: dict[str, Any], errors: list[str], drafter: str,
           max_new_tokens: int) -> dict[str, Any]:
    """Print the row as a table and write the JSON (``--out``)."""
    print("\n" + markdown_table([row], [(k, k) for k in row]))
    if errors:
        print(f"first client error: {errors[0]}")
    args.dtype, args.drafter, args.max_new_tokens = "float32", drafter, max_new_tokens
    payload = {"machine": machine_record(args), "args": vars(args), "rows": [row],
               "client_errors": errors[:20]}
    write_json(args.out, payload)
    return payload
