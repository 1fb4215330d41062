"""``gpu``: the verifier engine on one accelerator, in one command (issue #13's measurements).

Builds Qwen2.5-Coder-shaped models from their configs with random weights (1.5B target, 0.5B
drafter; real weights are not needed for speed) unless ``--target`` / ``--drafter`` name real
ones, then prints tables and writes one JSON:

1. raw forward ms per block size (1, 5, 17 new tokens on a 512-token context): plain
   transformers with a DynamicCache, and the verifier's engine (CausalEngine over the KV pool);
2. served verify call ms per k (round trip, and inside the server), one client, eager and with
   ``--cuda-graphs`` (static-shape buckets replayed as CUDA graphs);
3. target alone: ``/v1/generate`` tok/s next to transformers' ``generate()``;
4. aggregate tok/s at 1 / 8 / 32 / 64 / 128 concurrent n-gram clients, batching on and off, with
   the mean batch size and whether every client's output is the same both ways;
5. the drafter's cost ratio c = one drafted token / one target forward of one token, for the
   plain transformers drafter and the pooled one (client ``--cuda-graphs``);
6. the engine: one batched forward of 8 / 64 verify blocks with padded vs per-session attention,
   and their acceptance on the host vs on the device, greedy and sampled;
7. the HTTP layer: verify calls/s and the verifier's CPU per call with a tiny target on the
   same device, clients in separate processes (``python -m scripts.bench calls``).

  python -m scripts.bench gpu --device cuda                 # about 5-8 minutes on one GPU
  python -m scripts.bench gpu --shape tiny --device cpu      # a smoke run, seconds

Times on CUDA are taken after ``torch.cuda.synchronize()``. Clients are threads of this process
(the n-gram drafter costs almost nothing, but at 128 clients the client side's Python is part of
what is measured; the rows say how many clients ran).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from drafter_client.transport import HttpVerifier
from scripts.bench import calls
from scripts.bench.batching import on_off_sweep
from scripts.bench.common import (
    load_prompts,
    machine_record,
    markdown_table,
    median_ms,
    plain_step_ms,
    sync,
    write_json,
)
from shared.engines.target import ForwardItem
from shared.engines.transformers.drafter import HFDrafter
from shared.engines.transformers.pooled_drafter import PooledDrafter
from shared.engines.transformers.target import CausalEngine
from shared.models.catalog import load_causal_lm, load_tokenizer, pick_dtype
from shared.protocol.acceptance import Block, decide
from shared.protocol.sampling import SamplingConfig
from shared.protocol.schema import CreateSessionRequest, GenerateRequest, VerifyRequest
from tests.support.tiny_models import build_tokenizer
from verifier_service.launch import VerifierProcess

# Qwen2.5-Coder-1.5B / 0.5B (their config.json), and a tiny one for smoke runs.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                 "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                 "tie_word_embeddings": True},
    "qwen0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                 "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                 "tie_word_embeddings": True},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
             "tie_word_embeddings": True},
}
CONTEXT = 512
REPEATS = 20  # timed calls per median (after 2 warm-up calls)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", choices=["qwen", "tiny"], default="qwen",
                        help="the random models' shapes: Qwen2.5-Coder 1.5B / 0.5B, or tiny")
    parser.add_argument("--target", help="a real target instead (folder, .gguf, short name)")
    parser.add_argument("--drafter", help="a real drafter instead")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 5, 17])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=30, help="verify calls per k")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--call-sessions", type=int, nargs="+", default=[1, 8, 64],
                        help="concurrent sessions in the HTTP-layer section")
    parser.add_argument("--call-seconds", type=float, default=5.0)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64],
                        help="verify blocks per batched forward in the engine section")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--out", default="bench_results/gpu.json")


def build_models(args: argparse.Namespace, root: Path) -> tuple[str, str]:
    """Folders of the target and drafter: the real ones named, else random Qwen-shaped ones."""
    names = ("tiny", "tiny") if args.shape == "tiny" else ("qwen1.5b", "qwen0.5b")
    specs = []
    for real, shape, seed in ((args.target, names[0], 1), (args.drafter, names[1], 2)):
        if real:
            specs.append(real)
            continue
        torch.manual_seed(seed)
        config = Qwen2Config(max_position_embeddings=32768, eos_token_id=1, bos_token_id=1,
                             **SHAPES[shape])
        folder = root / f"{shape}-{seed}"
        Qwen2ForCausalLM(config).to(pick_dtype(args.dtype, torch.device("cpu"))).save_pretrained(
            folder)
        build_tokenizer(config.vocab_size).save_pretrained(folder)
        specs.append(str(folder))
    return specs[0], specs[1]


@torch.inference_mode()
def raw_forwards(target: str, args: argparse.Namespace, device: torch.device,
                 dtype: torch.dtype) -> tuple[list[dict[str, Any]], float, Any]:
    model = load_causal_lm(target, dtype, device)
    vocab = int(model.config.vocab_size)
    context = [(i * 7919) % vocab for i in range(CONTEXT)]
    rows = []
    plain = {n: plain_step_ms(model, context, n, REPEATS, warm=2) for n in args.blocks}
    runner = CausalEngine(model, load_tokenizer(target), target, max_context=CONTEXT + 64,
                          kv_budget_tokens=CONTEXT + 64)
    slot = runner.allocate()
    assert slot is not None
    runner.forward([ForwardItem(slot, 0, context, False)])
    for n in args.blocks:
        ours = median_ms(lambda n=n: runner.forward(
            [ForwardItem(slot, CONTEXT, context[:n], True)]), REPEATS, device, warm=2)
        rows.append({"new_tokens": n, "plain_hf_ms": round(plain[n], 2),
                     "engine_ms": round(ours, 2)})
    one_token = plain[min(args.blocks)]
    runner.release(slot)
    model.set_attn_implementation("sdpa")  # back to transformers' own, for generate() below
    return rows, one_token, model


@torch.inference_mode()
def batched_engine(model: Any, target: str, args: argparse.Namespace,
                   device: torch.device) -> list[dict[str, Any]]:
    """One batched forward of B verify blocks (k = 4, 5 tokens each, 512-token contexts) with
    each attention layout, and the acceptance of its logits on the host (each job's rows
    copied, decided alone) vs on the device (one batched step), greedy and sampled."""
    vocab = int(model.config.vocab_size)
    most = max(args.batches)
    runner = CausalEngine(model, load_tokenizer(target), target, max_context=CONTEXT + 64,
                          kv_budget_tokens=(CONTEXT + 64) * most)
    context = [(i * 7919) % vocab for i in range(CONTEXT)]
    slots = [runner.allocate() for _ in range(most)]
    for slot in slots:
        runner.forward([ForwardItem(slot, 0, context, False)])  # type: ignore[arg-type]
    rows = []
    for batch in args.batches:
        items = [ForwardItem(slot, CONTEXT, context[b:b + 5], True)  # type: ignore[arg-type]
                 for b, slot in enumerate(slots[:batch])]
        row: dict[str, Any] = {"batch": batch}
        for mode in ("per-session", "padded"):
            runner.attention = mode
            row[f"{mode}_ms"] = round(median_ms(lambda items=items: runner.forward(items),
                                                REPEATS // 2, device, warm=2), 2)
        logits = [r for r in runner.forward(items) if r is not None]
        for name, config in (("greedy", SamplingConfig()),
                             ("sampled", SamplingConfig(temperature=0.7, top_p=0.95))):
            tasks = [Block(item.token_ids[1:], None, [-0.7] * 4, 0.5, config)
                     for item in items]

            def on_host(tasks: list[Block] = tasks,
                        logits: list[torch.Tensor] = logits) -> None:
                decide(logits, tasks, on_device=False)  # each job's rows copied, decided alone

            def on_device(tasks: list[Block] = tasks,
                          logits: list[torch.Tensor] = logits) -> None:
                decide(logits, tasks)

            row[f"host_{name}_ms"] = round(median_ms(on_host, 5, device, warm=1), 2)
            row[f"device_{name}_ms"] = round(median_ms(on_device, 5, device, warm=1), 2)
        print(row, flush=True)
        rows.append(row)
    for slot in slots:
        runner.release(slot)  # type: ignore[arg-type]
    return rows


def served_calls(url: str, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    verifier = HttpVerifier(url)
    rows = []
    context = [(i * 7919) % vocab for i in range(CONTEXT)]
    for k in args.ks:
        session = verifier.create_session(CreateSessionRequest(prompt_ids=context))
        position, last = len(context), context[-1]
        trips, inside = [], []
        for call in range(args.calls + 2):
            drafts = [(position * 31 + i) % vocab for i in range(k)]
            started = time.perf_counter()
            reply = verifier.verify(session.session_id, VerifyRequest(
                position=position, last_token=last, draft_ids=drafts,
                log_uniforms=[-1.0] * k, final_uniform=0.5))
            if call >= 2:  # the first two warm the path
                trips.append(time.perf_counter() - started)
                inside.append(reply.forward_ms / 1e3)
            position = reply.position
            last = reply.next_token if reply.next_token is not None else drafts[-1]
            if position + 17 > CONTEXT + 512:
                break
        verifier.delete_session(session.session_id)
        rows.append({"k": k, "round_trip_ms": round(1e3 * statistics.median(trips), 2),
                     "inside_server_ms": round(1e3 * statistics.median(inside), 2)})
    verifier.close()
    return rows


def target_alone(url: str, model: Any, args: argparse.Namespace,
                 device: torch.device) -> dict[str, Any]:
    vocab = int(model.config.vocab_size)
    prompt = [(i * 7919) % vocab for i in range(64)]
    verifier = HttpVerifier(url)
    verifier.generate(GenerateRequest(prompt_ids=prompt, max_new_tokens=4, stop_at_eos=False))
    started = time.perf_counter()
    served = verifier.generate(GenerateRequest(prompt_ids=prompt, stop_at_eos=False,
                                               max_new_tokens=args.max_new_tokens))
    served_s = time.perf_counter() - started
    verifier.close()
    ids = torch.tensor([prompt], device=device)
    kwargs = {"do_sample": False, "max_new_tokens": args.max_new_tokens,
              "min_new_tokens": args.max_new_tokens, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(device)
        started = time.perf_counter()
        model.generate(ids, **kwargs)
        sync(device)
        hf_s = time.perf_counter() - started
    return {"served_tok_s": round(len(served.token_ids) / served_s, 2),
            "hf_generate_tok_s": round(args.max_new_tokens / hf_s, 2)}


@torch.inference_mode()
def drafter_cost(drafter: str, device: torch.device, dtype: torch.dtype,
                 target_one_token_ms: float) -> dict[str, Any]:
    """ms per drafted token (greedy blocks of 4 on a CONTEXT-token prefix) for the plain
    transformers drafter and the pooled one (``--cuda-graphs``: KV slot, captured steps on
    CUDA), and c = that / one target forward of one token."""
    model = load_causal_lm(drafter, dtype, device)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    context = [(i * 7919) % int(model.config.vocab_size) for i in range(CONTEXT)]
    result: dict[str, Any] = {"target_ms_one_token": round(target_one_token_ms, 2)}
    # The plain drafter first: the pooled one switches the model to the slot pool's attention.
    for name, make in (("plain", lambda: HFDrafter(model, vocab)),
                       ("cuda_graphs", lambda: PooledDrafter(model, vocab, CONTEXT + 64))):
        ours = make()
        ours.reset(context)
        ours._forward(context[:-1])

        def block(ours: HFDrafter = ours) -> None:  # 4 drafter forwards, then roll back
            ours.propose(4, SamplingConfig(), torch.Generator())
            ours.commit([])

        per_token = median_ms(block, REPEATS, device, warm=2) / 4
        result[f"{name}_ms_per_token"] = round(per_token, 2)
        result[f"{name}_c"] = round(per_token / target_one_token_ms, 3)
    return result


def http_layer(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """Verify calls per second with a tiny target on the same device, so the HTTP layer (not
    the model) is what is measured; clients in ``--client-processes`` processes
    (``python -m scripts.bench calls``)."""
    tiny = calls.tiny_target(root / "calls-target")
    calls_args = argparse.Namespace(k=4, seconds=args.call_seconds,
                                    client_processes=args.client_processes)
    flags = calls.verifier_flags(tiny, args.device, "float32", max(args.call_sessions), 4)
    rows = []
    with VerifierProcess(flags, threads=args.threads or 1) as process:
        assert process.proc is not None
        for sessions in args.call_sessions:
            rows.append(calls.measure(process.url, process.proc.pid, sessions, calls_args,
                                      1024))
            print(rows[-1], flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every section in turn; the JSON (``--out``) is written after each one, with how long each
    took, so a run cut off by its time limit keeps what it measured; each verifier's output goes
    to a log file next to it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = pick_dtype(args.dtype, device)
    root = Path(tempfile.mkdtemp(prefix="specdec-gpu-"))
    logs = Path(args.out).parent
    started = time.perf_counter()
    payload: dict[str, Any] = {"section_s": {}}
    clock = [time.perf_counter()]

    def save(section: str, **results: Any) -> None:
        now = time.perf_counter()
        payload["section_s"][section] = round(now - clock[0], 1)
        clock[0] = now
        payload.update(results)
        payload["machine"] = {
            **machine_record(_machine_args(args, target, drafter)), "device": args.device,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "context": CONTEXT, "wall_s": round(now - started)}
        write_json(args.out, payload)

    def verifier(flags: list[str], name: str) -> VerifierProcess:
        return VerifierProcess(flags, threads=args.threads or 1,
                               log_path=logs / f"verifier-{name}.log")

    target, drafter = build_models(args, root)
    print(f"models ready in {time.perf_counter() - started:.0f} s", flush=True)
    save("models")

    raw, one_token_ms, model = raw_forwards(target, args, device, dtype)
    print(markdown_table(raw, [("new_tokens", "new tokens"), ("plain_hf_ms", "plain HF ms"),
                               ("engine_ms", "specdec engine ms")]), flush=True)
    save("raw_forward", raw_forward=raw)
    engine = batched_engine(model, target, args, device)
    print(markdown_table(engine, [
        ("batch", "blocks of 5"), ("per-session_ms", "forward, per-session attention ms"),
        ("padded_ms", "forward, padded attention ms"), ("host_greedy_ms", "host accept greedy"),
        ("device_greedy_ms", "device accept greedy"), ("host_sampled_ms", "host accept T=0.7"),
        ("device_sampled_ms", "device accept T=0.7")]), flush=True)
    save("batched_engine", batched_engine=engine)
    model.set_attn_implementation("sdpa")
    vocab = int(model.config.vocab_size)
    base = ["--model", target, "--dtype", args.dtype, "--device", args.device,
            "--max-context", str(CONTEXT + 1024), "--kv-budget-tokens",
            str(max(args.clients) * (CONTEXT + 1024)), "--max-sessions",
            str(max(args.clients) + 8), "--max-batch-size", str(max(args.clients)),
            "--max-batch-tokens", str(max(args.clients) * 24)]
    with verifier(base, "served") as process:
        calls = served_calls(process.url, args, vocab)
        print(markdown_table(calls, [("k", "k"), ("round_trip_ms", "round trip ms"),
                                     ("inside_server_ms", "inside the server ms")]), flush=True)
        save("served_calls", served_calls=calls)
        alone = target_alone(process.url, model, args, device)
        save("target_alone", target_alone=alone)
    with verifier([*base, "--cuda-graphs"], "cuda-graphs") as process:
        graphed = served_calls(process.url, args, vocab)  # buckets captured on first use
        print("with --cuda-graphs:\n" + markdown_table(graphed, [
            ("k", "k"), ("round_trip_ms", "round trip ms"),
            ("inside_server_ms", "inside the server ms")]), flush=True)
        print(f"target alone: served {alone['served_tok_s']} tok/s, transformers generate "
              f"{alone['hf_generate_tok_s']} tok/s", flush=True)
        save("served_calls_cuda_graphs", served_calls_cuda_graphs=graphed)
    del model
    prompts, _ = load_prompts("repeat")

    @contextlib.contextmanager
    def start(batching: bool) -> Iterator[str]:
        flags = ["--batching" if batching else "--no-batching"]
        name = "batching-on" if batching else "batching-off"
        with verifier([*base, *flags], name) as process:
            yield process.url

    aggregate, table = on_off_sweep(start, prompts, args.clients, args.max_new_tokens, 4)
    for row in aggregate:
        del row["outputs"]
    save("aggregate", aggregate=aggregate, aggregate_table=table)
    cost = drafter_cost(drafter, device, dtype, one_token_ms)
    print(f"drafter per drafted token: plain {cost['plain_ms_per_token']} ms (c = "
          f"{cost['plain_c']}), --cuda-graphs {cost['cuda_graphs_ms_per_token']} ms (c = "
          f"{cost['cuda_graphs_c']}); target {cost['target_ms_one_token']} ms per token",
          flush=True)
    save("drafter", drafter=cost)
    http = http_layer(args, root)
    save("http_layer", http_layer=http)
    print(f"sections (s): {payload['section_s']}", flush=True)
    return payload


def _machine_args(args: argparse.Namespace, target: str, drafter: str) -> argparse.Namespace:
    return argparse.Namespace(threads=args.threads, dtype=args.dtype, target=target,
                              drafter=drafter, max_new_tokens=args.max_new_tokens)
