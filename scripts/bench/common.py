"""What every benchmark shares: base options, the verifier's lifecycle, prompts, tables, JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

from shared.engines.transformers.timing import median_ms, plain_step_ms, sync  # noqa: F401 - the benchmarks' own
from shared.models.fetch import fetch_offline_models
from verifier_service.launch import VerifierProcess

ROOT = Path(__file__).resolve().parents[2]
PROMPT_DIR = ROOT / "benchmarks" / "prompts"


def add_base_arguments(parser: argparse.ArgumentParser, out: str, max_new_tokens: int = 64,
                       engines: tuple[str, ...] = ("transformers", "llama-cpp", "auto")) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="the verifier's model: short name, folder, .gguf file or hub id")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b",
                        help="the model drafter (also transformers' assistant model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--dtype", default="auto", help="auto (bf16), float32, bfloat16")
    parser.add_argument("--engine", default="transformers",
                        choices=engines,
                        help="what runs both models (the verifier's --engine, the drafter's "
                        "--drafter-engine); these benchmarks measure the transformers engine "
                        "next to transformers' own generate(), `python -m scripts.bench llama` "
                        "the llama.cpp engine next to llama-server")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--out", default=out, help="where the JSON (and other files) go")


@contextlib.contextmanager
def verifier(args: argparse.Namespace, *extra: str, quiet: bool = True) -> Iterator[str]:
    """A ``specdec-verifier`` for ``args.target`` on a free loopback port; yields its URL and
    stops it (SIGTERM, then SIGKILL) afterwards."""
    fetch_offline_models(args.target)
    with VerifierProcess(["--model", args.target, "--dtype", args.dtype,
                          "--engine", args.engine, *extra],
                         threads=args.threads, quiet=quiet) as process:
        yield process.url


def load_prompts(name: str) -> tuple[list[str], bool]:
    """``benchmarks/prompts/<name>.json``: (prompts, whether they take the chat template)."""
    data = json.loads((PROMPT_DIR / f"{name.replace('-', '_')}.json").read_text())
    return list(data["prompts"]), bool(data["chat"])


def at_once(calls: list[Callable[[], Any]]) -> tuple[list[Any], float]:
    """Every call on its own thread, all started together: their results, in order, and the
    wall seconds from the first start to the last return."""
    results: list[Any] = [None] * len(calls)

    def work(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """``columns``: (key, title) pairs; floats with 3 significant digits, lists space-joined."""
    def fmt(v: Any) -> str:
        if v is None or v == [] or v == "None":
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        if isinstance(v, list):
            return " ".join(f"{x:.2f}" for x in v)
        return str(v)

    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(key)) for key, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def machine_record(args: argparse.Namespace) -> dict[str, Any]:
    return {"threads": args.threads, "dtype": args.dtype, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "target": args.target, "drafter": args.drafter,
            "max_new_tokens": args.max_new_tokens}


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return out


ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                  "assistant_confidence_threshold")


def assistant_defaults(drafter: Any) -> dict[str, Any]:
    """The assistant-model settings of a drafter's generation config, as loaded."""
    return {key: getattr(drafter.generation_config, key, None) for key in ASSISTANT_KEYS}


@torch.inference_mode()
def hf_generate(target: Any, ids: list[int], max_new: int, eos: list[int], *,
                method: str = "alone", k: int | None = None, drafter: Any = None,
                defaults: dict[str, Any] | None = None, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = 0) -> tuple[list[int], float]:
    """transformers' own ``generate()``: the target ``alone``, ``assisted`` by ``drafter``
    (its default schedule - ``defaults`` restored first - or a constant ``k``), or prompt
    ``lookup`` (k tokens, default 10). Returns (generated ids, wall seconds)."""
    input_ids = torch.tensor([ids], device=target.device)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new,
                              "attention_mask": torch.ones_like(input_ids),
                              "pad_token_id": eos[0], "eos_token_id": eos}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=top_p)
        torch.manual_seed(seed)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if method == "assisted":
        config = drafter.generation_config
        kwargs["assistant_model"] = drafter
        for key, value in (defaults or {}).items():  # undo the last run's changes
            setattr(config, key, value)
        if k is not None:  # a constant draft length, like specdec's fixed k
            config.num_assistant_tokens = k
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0
    elif method == "lookup":
        kwargs["prompt_lookup_num_tokens"] = k or 10
    started = time.perf_counter()
    out = target.generate(input_ids, **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - started
