"""``gpu-smoke``: the GPU engine's first-contact checks, in under 2 minutes (issue #24).

Run it first on a lent GPU machine, before the benchmark: what it checks would otherwise fail
minutes into a lease. One line per check; the JSON (``--out``) is written after each one.

1. ``graph_replay``: a batch of verify blocks and a decode step through a static-shape bucket
   (captured as a CUDA graph on CUDA, run eagerly elsewhere) gives the eager forward's logits;
2. ``host_syncs``: the host syncs (CUDA's sync debug mode) and host-to-device copies of one
   batched forward of 4 verify blocks with its device acceptance, eager and through a bucket;
3. ``attention``: which SDPA kernel each kind of ragged-attention call runs at the 1.5B Qwen
   head layout (and the masked ``enable_gqa`` call it replaced);
4. ``served_verify``: verify calls through a verifier in this process (``--cuda-graphs``): a
   block of the target's greedy tokens is accepted whole, a block with a wrong second token
   stops there, and both next tokens are the target's;
5. ``greedy_generation``: a greedy speculative generation (its drafter on the same device)
   equals transformers' ``generate()`` of the target on that device.

Tiny fp32 models with random weights, built here; nothing is downloaded.

  python -m scripts.bench gpu-smoke --device cuda --out bench_results/gpu-smoke.json
  python -m scripts.bench gpu-smoke --device cpu            # the same checks on CPU (seconds)
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from scripts.bench.common import write_json
from scripts.bench.gpu import SHAPES
from shared.engines.target import ForwardItem, Step
from shared.engines.transformers.kv_pool import attention_kernels
from shared.engines.transformers.target import CausalEngine
from shared.models.catalog import load_causal_lm, load_tokenizer
from shared.protocol.acceptance import Block
from shared.protocol.sampling import SamplingConfig
from shared.protocol.transfer import Upload
from tests.support.tiny_models import build_tokenizer, save_perturbed

CONTEXT = 256  # the tiny models' positions
PROMPT = [(i * 37 + 5) % 1000 + 2 for i in range(40)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--out", default="bench_results/gpu-smoke.json")


def build_pair(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen2-shaped target (grouped-query heads, as the real ones) and a drafter close
    to it, with a word-level tokenizer, saved under ``root``."""
    torch.manual_seed(1)
    config = Qwen2Config(max_position_embeddings=CONTEXT, eos_token_id=1, bos_token_id=1,
                         initializer_range=0.3, **SHAPES["tiny"])
    target = root / "target"
    Qwen2ForCausalLM(config).save_pretrained(target)
    build_tokenizer(config.vocab_size).save_pretrained(target)
    return target, save_perturbed(target, root / "drafter", noise=0.01, seed=2)


def engine_on(path: Path, device: torch.device) -> CausalEngine:
    model = load_causal_lm(str(path), torch.float32, device)
    return CausalEngine(model, load_tokenizer(str(path)), str(path), max_context=CONTEXT,
                        kv_budget_tokens=CONTEXT * 8)


def prefilled(engine: CausalEngine, lengths: tuple[int, ...]) -> list[int]:
    slots = []
    for n in lengths:
        slot = engine.allocate()
        assert slot is not None
        engine.forward([ForwardItem(slot, 0, PROMPT[:n], False)])
        slots.append(slot)
    return slots


def batch_items(slots: list[int], lengths: tuple[int, ...]) -> list[ForwardItem]:
    blocks = [PROMPT[3:8], PROMPT[9:10], PROMPT[11:14], PROMPT[20:25]]
    return [ForwardItem(slot, n, block, True)
            for slot, n, block in zip(slots, lengths, blocks, strict=False)]


@torch.inference_mode()
def graph_replay(target: Path, device: torch.device) -> dict[str, Any]:
    lengths = (30, 12, 21)
    eager, static = engine_on(target, device), engine_on(target, device)
    eager.attention = static.attention = "padded"
    started = time.perf_counter()
    static.enable_static_forwards(max_batch=4)  # on CUDA: every bucket captured
    capture_s = time.perf_counter() - started
    assert static.static is not None
    want = eager.forward(batch_items(prefilled(eager, lengths), lengths))
    replays = static.static.replays
    got = static.forward(batch_items(prefilled(static, lengths), lengths))
    diff = max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True)
               if a is not None and b is not None)
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(want, got, strict=True)
               if a is not None and b is not None)
    return {"ok": same and diff < 1e-3 and static.static.replays > replays,
            "captured": static.static.capture, "buckets": len(static.static.buckets),
            "build_s": round(capture_s, 2), "max_abs_diff": diff, "argmax_equal": same}


def count_syncs(engine: CausalEngine, steps: list[Step], device: torch.device) -> dict[str, Any]:
    """Syncs (CUDA only) and uploads of one ``engine.run``."""
    uploads = Upload.count
    if device.type != "cuda":
        engine.run(steps)
        return {"syncs": None, "uploads": Upload.count - uploads}
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.run(steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    return {"syncs": len(syncs), "uploads": Upload.count - uploads}


@torch.inference_mode()
def host_syncs(target: Path, device: torch.device) -> dict[str, Any]:
    lengths = (30, 12, 21, 40)
    row: dict[str, Any] = {}
    for name in ("eager", "static"):
        engine = engine_on(target, device)
        engine.attention = "padded"
        if name == "static":
            engine.enable_static_forwards(max_batch=4)
        slots = prefilled(engine, lengths)
        for sampling, config in (("greedy", SamplingConfig()),
                                 ("sampled", SamplingConfig(temperature=0.8, top_p=0.9))):
            steps = [Step(item, Block(item.token_ids[1:], None, [-0.5] * (len(item.token_ids) - 1),
                                      0.5, config, item.start + 1))
                     for item in batch_items(slots, lengths)]
            engine.run(steps)  # once untimed: kernels and allocator warm
            row[f"{name}_{sampling}"] = count_syncs(engine, steps, device)
    uploads = [v["uploads"] for v in row.values()]
    syncs = [v["syncs"] for v in row.values() if v["syncs"] is not None]
    # one upload per forward; the verdicts come back in one copy (greedy), a few when sampling
    return {"ok": max(uploads) <= 1 and (not syncs or max(syncs) <= 6), **row}


def attention(device: torch.device) -> dict[str, Any]:
    config = Qwen2Config(**SHAPES["qwen1.5b"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = attention_kernels(config, dtype, device)
    fused = all(v not in ("MATH", "unknown") for k, v in kernels.items()
                if k in ("padded_group", "decode_step", "prefill"))
    return {"ok": fused or device.type != "cuda", "dtype": str(dtype).removeprefix("torch."),
            **kernels}


def reference_greedy(target: Path, device: torch.device, n: int) -> list[int]:
    model = load_causal_lm(str(target), torch.float32, device)
    out = model.generate(torch.tensor([PROMPT], device=device), do_sample=False,
                         max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(PROMPT):].tolist()]


def served(target: Path, drafter: Path, device: torch.device) -> dict[str, dict[str, Any]]:
    """Checks 4 and 5 on one verifier in this process."""
    try:
        from drafter_client import SpecDecClient
        from drafter_client.transport import HttpVerifier
        from shared.protocol.schema import CreateSessionRequest, VerifyRequest
        from tests.support.servers import ThreadedServer
        from verifier_service.app import create_app, server_options
        from verifier_service.settings import Settings
    except ImportError as exc:  # the web stack was not carried to this machine
        skipped = {"ok": False, "error": f"not run: {exc}"}
        return {"served_verify": skipped, "greedy_generation": skipped}
    greedy = reference_greedy(target, device, 24)
    settings = Settings(model=str(target), dtype="float32", device=str(device),
                        max_context=CONTEXT, kv_budget_tokens=CONTEXT * 8, cuda_graphs=True,
                        max_draft_tokens=8, max_batch_size=4)
    results: dict[str, dict[str, Any]] = {}
    with ThreadedServer(create_app(settings), **server_options(settings)) as server:
        verifier = HttpVerifier(server.url)
        replies = []
        for drafts in (greedy[:4], [greedy[0], (greedy[1] + 1) % 1000 + 2, *greedy[2:4]]):
            session = verifier.create_session(CreateSessionRequest(prompt_ids=PROMPT))
            reply = verifier.verify(session.session_id, VerifyRequest(
                position=len(PROMPT), last_token=PROMPT[-1], draft_ids=drafts,
                log_uniforms=[-0.5] * 4, final_uniform=0.5))
            replies.append([reply.num_accepted, reply.next_token])
            verifier.delete_session(session.session_id)
        results["served_verify"] = {
            "ok": replies == [[4, greedy[4]], [1, greedy[1]]],
            "replies": replies, "expected": [[4, greedy[4]], [1, greedy[1]]]}
        client = SpecDecClient(server.url, str(drafter), dtype="float32", device=str(device))
        result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=24)
        results["greedy_generation"] = {
            "ok": result.token_ids == greedy[:len(result.token_ids)] and len(result.token_ids) > 0,
            "tokens": len(result.token_ids), "accepted": result.metrics.accepted_tokens,
            "verify_calls": result.metrics.verify_calls}
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    payload: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                               "checks": {}, "seconds": {}}
    if device.type == "cuda":
        payload["gpu"] = torch.cuda.get_device_name(device)

    def record(name: str, result: dict[str, Any], started: float) -> None:
        payload["checks"][name] = result
        payload["seconds"][name] = round(time.perf_counter() - started, 2)
        detail = {k: v for k, v in result.items() if k != "ok"}
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {name}: {detail}", flush=True)
        write_json(args.out, payload)

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        target, drafter = build_pair(Path(tmp))
        for name, check in (("graph_replay", lambda: graph_replay(target, device)),
                            ("host_syncs", lambda: host_syncs(target, device)),
                            ("attention", lambda: attention(device))):
            started = time.perf_counter()
            try:
                result = check()
            except Exception as exc:  # noqa: BLE001 - reported as the check's failure
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            record(name, result, started)
        started = time.perf_counter()
        try:
            served_results = served(target, drafter, device)
        except Exception as exc:  # noqa: BLE001
            failed = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            served_results = {"served_verify": failed, "greedy_generation": failed}
        for name, result in served_results.items():
            record(name, result, started)
    failed_checks = [n for n, r in payload["checks"].items() if not r["ok"]]
    print("all checks passed" if not failed_checks else f"FAILED: {', '.join(failed_checks)}")
    payload["passed"] = not failed_checks
    write_json(args.out, payload)
    return payload
