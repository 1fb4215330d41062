"""How close each CPU engine's target is to the bf16 model it quantizes, token by token.

The bf16 model (transformers, the converted folder) continues each benchmark prompt greedily
for ``--max-new-tokens``; every system then scores that same sequence (teacher-forced: one
forward of every row, through the system's own engine code), and at each position of the
continuation its next-token choice is compared with bf16's. Reported per system: how often
the top token agrees with bf16's, the mean KL divergence KL(bf16 || system) of the next-token
distributions, and the mean absolute logit difference. Greedy output of a quantized target
drifts from bf16's at its first disagreement; this counts the disagreements without letting
one of them change the text every later position is scored on.

Systems: ``int8 outliers 0`` (the int8 engine's default: 8-bit activations where the CPU has
VNNI, 7-bit on AVX2 alone), ``int8 outliers 8`` (``--int8-outliers 8``), ``int8 7-bit outliers
8`` (7-bit activations forced, to compare), ``Q4_K_M`` (the GGUF file on the llama.cpp
engine's exact kernels) and ``w4a8`` (the same file on the w4a8 engine, the default).

The converted bf16 folder is the Q4_K_M file dequantized (``shared/models/fetch.py``): its
weights are Q4_K_M's exactly, so Q4_K_M differs from it only by llama.cpp's arithmetic and
activation quantization, and the int8 engine requantizes those weights.

    python -m scripts.bench quality --prompts 2 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import torch

from scripts.bench.common import markdown_table, write_json
from scripts.bench.llama import prompt_ids
from scripts.bench.suite import WORKLOADS, workloads
from shared.engines import load_target
from shared.engines.int8.kernels import (
    OUTLIERS,
    Int8Linear,
    activation_bits,
    quantized_engine,
)
from shared.engines.int8.model import Int8Decoder, Rows
from shared.engines.target import BatchForward, ForwardItem
from shared.models.catalog import load_causal_lm, load_tokenizer
from verifier_service.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a short name of the offline pair (its converted folder and GGUF)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    systems = ["w4a8", "Q4_K_M", "int8 outliers 8", "int8 outliers 0", "int8 7-bit outliers 8"]
    parser.add_argument("--systems", nargs="+", default=systems, choices=systems)
    parser.add_argument("--out", default="bench_results/quality.json")


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, list[float]]:
    """Per position: top-token agreement, KL(reference || logits), mean |logit difference|."""
    ref, got = reference.double(), logits.double()
    p_log, q_log = torch.log_softmax(ref, dim=-1), torch.log_softmax(got, dim=-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(dim=-1)
    return {"agree": (ref.argmax(-1) == got.argmax(-1)).double().tolist(),
            "kl": kl.tolist(), "abs_logit": (ref - got).abs().mean(dim=-1).tolist()}


def int8_scorer(model: Any, context: int, reduce_range: bool | None,
                outliers: int = OUTLIERS) -> Any:
    linear = functools.partial(Int8Linear, reduce_range=reduce_range)
    decoder = Int8Decoder(model, 1, context, linear=linear,  # type: ignore[arg-type]
                          outliers=outliers)

    def score(ids: list[int]) -> torch.Tensor:
        rows = Rows(torch.tensor(ids), [0] * len(ids), list(range(len(ids))))
        return decoder.forward(rows, torch.arange(len(ids)))
    return score


def gguf_scorer(args: argparse.Namespace, context: int, engine_name: str) -> Any:
    """The GGUF file on an engine that reads it (llama.cpp's exact kernels, or w4a8)."""
    settings = Settings(model=args.target, max_context=context, kv_budget_tokens=context,
                        threads=args.threads)
    engine = load_target(engine_name, settings.target_options(), settings.engine_options())
    assert isinstance(engine, BatchForward)
    slot = engine.allocate()

    def score(ids: list[int]) -> torch.Tensor:
        logits = engine.forward([ForwardItem(slot, 0, ids, True)])[0]
        assert logits is not None
        return logits.float()
    return score


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    quantized_engine()
    tokenizer = load_tokenizer(args.target)
    model = load_causal_lm(args.target, torch.bfloat16, torch.device("cpu"))
    sequences = []  # (workload, ids, where the continuation starts)
    started = time.perf_counter()
    for workload, prompts in workloads(args.prompts).items():
        if workload not in args.workloads:
            continue
        for prompt in prompts:
            ids = prompt_ids(tokenizer, prompt)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                     do_sample=False, top_p=None, top_k=None, temperature=None)
            sequences.append((workload, out[0].tolist(), len(ids)))
    print(f"bf16 continuations: {time.perf_counter() - started:.0f} s", flush=True)
    context = max(len(ids) for _, ids, _ in sequences) + 1
    with torch.no_grad():
        references = [model(torch.tensor([ids])).logits[0].float() for _, ids, _ in sequences]
    scorers = {}
    for name in args.systems:
        if name == "int8 outliers 8":
            scorers[name] = int8_scorer(model, context, None)
        elif name == "int8 outliers 0":
            scorers[name] = int8_scorer(model, context, None, outliers=0)
        elif name == "int8 7-bit outliers 8":
            scorers[name] = int8_scorer(model, context, True)
    del model
    if "Q4_K_M" in args.systems:
        scorers["Q4_K_M"] = gguf_scorer(args, context, "llama-cpp")
    if "w4a8" in args.systems:
        scorers["w4a8"] = gguf_scorer(args, context, "w4a8")
    per: dict[tuple[str, str], dict[str, list[float]]] = {}
    with torch.no_grad():
        for (workload, ids, start), reference in zip(sequences, references, strict=True):
            positions = slice(start - 1, len(ids) - 1)  # rows that predict the continuation
            for name, score in scorers.items():
                found = compare(reference[positions], score(ids)[positions])
                entry = per.setdefault((name, workload), {"agree": [], "kl": [], "abs_logit": []})
                for key, values in found.items():
                    entry[key] += values
    rows = []
    for name in scorers:
        for workload in [*args.workloads, "all"]:
            entries = [v for (n, w), v in per.items() if n == name and workload in (w, "all")]
            agree = [x for e in entries for x in e["agree"]]
            rows.append({"system": name, "workload": workload, "positions": len(agree),
                         "top_token_agreement": statistics.fmean(agree),
                         "kl": statistics.fmean(x for e in entries for x in e["kl"]),
                         "abs_logit": statistics.fmean(x for e in entries
                                                       for x in e["abs_logit"])})
    table = markdown_table(rows, [
        ("system", "system"), ("workload", "workload"), ("positions", "positions"),
        ("top_token_agreement", "top token = bf16's"), ("kl", "KL(bf16 || system)"),
        ("abs_logit", "mean |logit - bf16's|")])
    print(table)
    payload = {"command": getattr(args, "command_line", "python -m scripts.bench quality"),
               "args": {k: v for k, v in vars(args).items() if k != "command_line"},
               "cpus": os.cpu_count(), "int8_activation_bits": activation_bits(),
               "rows": rows, "table": table}
    write_json(args.out, payload)
    return payload
