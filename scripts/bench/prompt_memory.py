"""The verifier's peak resident memory while it writes one long prompt, on each engine.

For each engine a ``specdec-verifier`` starts with one session slot long enough for the longest
prompt; once it is ready (weights loaded, verify costs timed) its resident memory is read, the
kernel's record of its peak is reset (``/proc/PID/clear_refs``), one session is opened with a
prompt of N tokens and takes its first step (which writes the prompt), and the peak is read
again. "Above idle" is what writing the prompt took
beyond the weights and the KV cache, which are allocated at start: with prompts written in
chunks (``PREFILL_CHUNK``, ``shared/engines/target.py``) it should not grow with N.

  python -m scripts.bench prompt-memory [--engines llama-cpp w4a8 int8 transformers]
      [--prompt-tokens 2048 16384] [--target qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.common import machine_record, markdown_table, write_json
from shared.models.catalog import offline_gguf_path
from shared.models.fetch import fetch_offline_models
from verifier_service.launch import VerifierProcess


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name of the offline pair (its GGUF for llama-cpp and "
                        "w4a8, its converted folder for the others)")
    parser.add_argument("--engines", nargs="+",
                        default=["llama-cpp", "w4a8", "int8", "transformers"])
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[2048, 16384])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/prompt_memory.json")


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def one_prompt(verifier: VerifierProcess, tokens: int) -> dict[str, Any]:
    """Opens a session on a prompt of ``tokens`` ids, measuring the server's memory around it."""
    assert verifier.proc is not None
    pid = verifier.proc.pid
    idle = status_kib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    prompt = [(7 * i) % 5000 + 100 for i in range(tokens)]  # ordinary ids, no special tokens
    started = time.perf_counter()
    created = httpx.post(verifier.url + "/v1/sessions", json={"prompt_ids": prompt},
                         timeout=60)
    created.raise_for_status()
    session = f"{verifier.url}/v1/sessions/{created.json()['session_id']}"
    # the prompt is written with the session's first step: a plain one here
    step = httpx.post(session + "/verify", timeout=3600, json={
        "position": tokens, "last_token": prompt[-1], "draft_ids": [], "log_uniforms": [],
        "final_uniform": 0.5})
    seconds = time.perf_counter() - started
    step.raise_for_status()
    peak = status_kib(pid, "VmHWM")
    httpx.delete(session, timeout=60)
    return {"prompt_tokens": tokens, "rss_idle_mib": round(idle / 1024),
            "rss_peak_mib": round(peak / 1024), "above_idle_mib": round((peak - idle) / 1024),
            "prefill_s": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    fetch_offline_models(args.target)
    context = max(args.prompt_tokens) + 256
    rows = []
    for engine in args.engines:
        gguf = engine in ("llama-cpp", "w4a8")
        model = str(offline_gguf_path(args.target)) if gguf else args.target
        extra = ["--dtype", "auto"] if engine == "transformers" else []
        with VerifierProcess(["--model", model, "--engine", engine, "--max-context",
                              str(context), "--kv-budget-tokens", str(context), *extra],
                             threads=args.threads, ready_timeout_s=1800) as verifier:
            for tokens in args.prompt_tokens:
                rows.append({"engine": engine, **one_prompt(verifier, tokens)})
                print(rows[-1], flush=True)
    columns = [(k, k) for k in ("engine", "prompt_tokens", "rss_idle_mib", "rss_peak_mib",
                                "above_idle_mib", "prefill_s", "tokens_per_s")]
    print("\n" + markdown_table(rows, columns))
    args.dtype, args.drafter, args.max_new_tokens = "per engine", "none", 0
    payload = {"machine": machine_record(args), "args": vars(args), "rows": rows}
    write_json(args.out, payload)
    return payload
