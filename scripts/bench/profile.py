"""``profile``: where a speculative block's time goes, component by component, in one process.

Times, on the same models, dtype and threads as the benchmarks (medians of repeated calls):

  * the drafter: one plain transformers decode step (KV cache, logits of the last position) vs
    specdec's ``HFDrafter`` per drafted token (its processing of the row included); and a chat's
    next turn (the conversation re-sent with 16 new tokens): its first block with a fresh
    drafter vs with the drafter keeping its cached prefix;
  * the target: plain transformers with a DynamicCache vs specdec's ``CausalEngine`` (KV slot
    pool + ragged attention), for 1 and for k + 1 new tokens; then one token on a second thread,
    and on the first thread again (a second thread running the model slows both: see
    ``verifier_service/state.py: ModelThread``).

The HTTP share of a verify call is read off the benchmarks' metrics (round trip minus forward).

  python -m scripts.bench profile --context 120 -k 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from scripts.bench.common import (
    add_base_arguments,
    fetch_offline_models,
    machine_record,
    markdown_table,
    median_ms,
    plain_step_ms,
    write_json,
)
from shared.engines.target import ForwardItem
from shared.engines.transformers.drafter import HFDrafter
from shared.engines.transformers.target import CausalEngine
from shared.models.catalog import load_causal_lm, load_tokenizer, pick_dtype
from shared.protocol.sampling import SamplingConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser, out="bench_results/profile.json")
    parser.add_argument("--context", type=int, default=120)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=12)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    fetch_offline_models(args.target, args.drafter)
    dtype, device = pick_dtype(args.dtype, torch.device("cpu")), torch.device("cpu")
    results: dict[str, float] = {}

    drafter = load_causal_lm(args.drafter, dtype, device)
    vocab = min(int(drafter.config.vocab_size), 30000)
    context = [(i * 7919) % vocab for i in range(args.context)]  # arbitrary, reproducible ids
    results["drafter: plain HF step (1 token)"] = plain_step_ms(drafter, context, 1,
                                                                args.repeats)
    ours = HFDrafter(drafter, int(drafter.get_output_embeddings().weight.shape[0]))

    ours.reset(context)
    ours._forward(context[:-1])  # the committed prefix is cached, as after a block

    def block() -> None:  # k drafts (k forwards: the last committed token, then k - 1 drafts)
        ours.propose(args.k, SamplingConfig(), torch.Generator())
        ours.commit([])  # roll the cache back to the committed prefix

    results["drafter: specdec HFDrafter per drafted token"] = median_ms(block,
                                                                        args.repeats) / args.k
    # A chat's next turn re-sends the conversation plus a new message: a drafter that keeps
    # its cached prefix feeds only the new tokens; a fresh one (as before) feeds them all.
    turn = [*context, *context[:16]]

    def next_turn_ms(keep: bool) -> float:
        times = []
        for _ in range(max(args.repeats // 3, 3)):
            ours.reset(context)  # the previous turn's sequence is cached (untimed)
            started = time.perf_counter()
            drafter_now = ours if keep else HFDrafter(drafter, ours.vocab_size)
            drafter_now.reset(turn)
            drafter_now.propose(args.k, SamplingConfig(), torch.Generator())
            times.append(1e3 * (time.perf_counter() - started))
        return statistics.median(times)

    for keep, label in ((False, "a fresh drafter"), (True, "the drafter keeping its prefix")):
        results[f"drafter: next turn (+16 tokens), first block, {label}"] = next_turn_ms(keep)

    target = load_causal_lm(args.target, dtype, device)
    for new in (1, args.k + 1):
        results[f"target: plain HF, {new} new token(s)"] = plain_step_ms(target, context, new,
                                                                        args.repeats)
    runner = CausalEngine(target, load_tokenizer(args.target), args.target,
                          max_context=args.context + 64, kv_budget_tokens=args.context + 64)
    slot = runner.allocate()
    assert slot is not None
    runner.forward([ForwardItem(slot, 0, context, False)])

    def step(new: int = 1) -> None:  # new tokens after the context, rolled back each time
        runner.forward([ForwardItem(slot, len(context), context[:new], True)])

    for new in (1, args.k + 1):
        results[f"target: specdec engine, {new} new token(s)"] = median_ms(
            lambda n=new: step(n), args.repeats)
    # A session's first block: its prompt written by a forward of its own (as creates did),
    # or in the block's forward (the deferred prefill, verifier_service/scheduling/jobs.py).
    prompt, first = context[:-1], [context[-1], *context[:args.k]]
    results[f"target: prompt, then a {args.k + 1}-token block (two forwards)"] = median_ms(
        lambda: (runner.forward([ForwardItem(slot, 0, prompt, False)]),
                 runner.forward([ForwardItem(slot, len(prompt), first, True)])), args.repeats)
    results[f"target: prompt and a {args.k + 1}-token block in one forward"] = median_ms(
        lambda: runner.forward([ForwardItem(slot, 0, prompt, False),
                                ForwardItem(slot, len(prompt), first, True)]), args.repeats)
    runner.forward([ForwardItem(slot, 0, context, False)])  # the context again, for what follows
    # Why the verifier runs all model work on one thread (verifier_service/state.py):
    # a second thread running the model gives the process a second OpenMP team.
    # (The old verifier's case: the loading thread lived on next to the serving one. The
    # slowdown lasts while both threads, and their OpenMP teams, live.)
    with ThreadPoolExecutor(1) as other:
        results["target: 1 new token, on a second thread"] = other.submit(
            median_ms, step, args.repeats).result()
        results["target: 1 new token, first thread again (the second alive)"] = median_ms(
            step, args.repeats)
    results["target: 1 new token, first thread (the second gone)"] = median_ms(
        step, args.repeats)

    print(f"\n{args.target} / {args.drafter}, {dtype}, {args.threads} threads, context "
          f"{args.context}, k={args.k}, medians of {args.repeats}\n")
    rows = [{"component": name, "ms": round(ms, 2)} for name, ms in results.items()]
    print(markdown_table(rows, [("component", "component"), ("ms", "ms")]))
    payload = {"machine": machine_record(args), "args": vars(args), "rows": rows}
    write_json(args.out, payload)
    return payload
