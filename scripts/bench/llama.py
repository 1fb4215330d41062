"""specdec on the llama.cpp engine next to llama.cpp's own ``llama-server``, same GGUF files.

One run, interleaved: every round runs every prompt on every system in turn, so a machine that
slows down or speeds up during the run affects all systems alike. Greedy, the same prompt token
ids everywhere; tok/s = new tokens / wall time of the whole request (prefill included), as the
user sees it. The peer is ``llama-server`` built from the llama.cpp source that
``llama-cpp-python`` vendors (cmake, cached in $SPECDEC_HOME/llama-server): its target alone,
its ``draft-simple`` speculation with the drafter GGUF, and its ``ngram-simple`` mode.

Every system's greedy output is checked against its own target alone in the same round (specdec
against specdec's ``baseline()`` on the same verifier; ``llama-server``'s modes against its
target alone): speculation must change the speed and nothing else. specdec runs on the default
exact kernels, and with ``--fast-kernels`` also on a second verifier with ``--kernels fast``
(llama.cpp's whole-batch kernels), to show what exactness costs. A last phase runs
``--concurrent`` default clients at once on the exact verifier and checks each output against
the same prompt run alone.

    python -m scripts.bench llama --rounds 2 --prompts 2 --max-new-tokens 128

Prints a table per workload and writes the JSON (every run, with its tokens) to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from scripts.bench.common import at_once, fetch_offline_models, markdown_table, write_json
from scripts.bench.suite import workloads
from scripts.llama_build import LLAMA_CPP_PYTHON, build_tag, cmake_args, unpack_sdist
from shared.engines.llama_cpp.runtime import amx_works, extra_buffer_types, repacked_layouts_run
from shared.machine_cache import specdec_home
from shared.models.catalog import OFFLINE_MODELS, load_tokenizer
from shared.models.fetch import fetch_gguf
from verifier_service.launch import VerifierProcess, free_port

WORKLOADS = ("code", "input-grounded", "english")


# -- the peer ------------------------------------------------------------------------------------
def llama_server_binary() -> Path:
    """``llama-server`` built once from the sdist of the pinned llama-cpp-python (about 8
    minutes on 2 cores), then reused; with the flags of specdec's own llama-cpp-python build
    (scripts/llama_build.py: AMX off on x86), so both run the same kernels."""
    home = specdec_home() / "llama-server" / LLAMA_CPP_PYTHON
    build = f"build-{build_tag()}"
    binary = home / "src" / "vendor" / "llama.cpp" / build / "bin" / "llama-server"
    if binary.exists():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "src").exists():
        unpack_sdist(sys.executable, home).rename(home / "src")
    source = home / "src" / "vendor" / "llama.cpp"
    log = home / f"{build}.log"
    print(f"building llama-server in {source / build} (minutes; output in {log})", flush=True)
    with log.open("w") as out:
        for step in (["cmake", "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                      "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *cmake_args()],
                     ["cmake", "--build", build, "--target", "llama-server", "-j",
                      str(os.cpu_count() or 1)]):
            if subprocess.run(step, cwd=source, stdout=out, stderr=out).returncode:
                raise RuntimeError(f"building llama-server failed: {' '.join(step)}; see {log}")
    return binary


def peer_modes(drafter: Path, threads: int) -> dict[str, list[str]]:
    """llama-server's systems, by name: its extra flags for the target alone, its own draft
    model and its n-gram drafting (which drafts from the prompt too)."""
    return {
        "llama-server: target alone": [],
        "llama-server: draft-simple -md drafter": ["--spec-type", "draft-simple", "-md",
                                                   str(drafter), "-td", str(threads)],
        "llama-server: ngram-simple": ["--spec-type", "ngram-simple"],
    }


class LlamaServer:
    """One ``llama-server`` process on a free port (``parallel`` slots of 4096 tokens each,
    continuously batched; greedy requests)."""

    def __init__(self, binary: Path, model: Path, threads: int, extra: list[str],
                 pin: str | None = None, parallel: int = 1) -> None:
        self.port = free_port()
        if not repacked_layouts_run(str(model), threads):
            extra = ["--no-repack", *extra]  # plain weights where AMX crashes, as specdec's
        self.cmd = [*(["taskset", "-c", pin] if pin else []), str(binary), "-m", str(model),
                    "--port", str(self.port), "-t", str(threads), "-c", str(4096 * parallel),
                    "-np", str(parallel),
                    "--no-webui", *extra]
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}  # its own ggml libraries
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {' '.join(self.cmd)}")
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become ready")

    def generate(self, ids: list[int], max_new: int) -> dict[str, Any]:
        started = time.perf_counter()
        reply = httpx.post(f"http://127.0.0.1:{self.port}/completion", timeout=600, json={
            "prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "ignore_eos": False}).json()
        wall = time.perf_counter() - started
        tokens = reply.get("tokens") or []
        timings = reply.get("timings", {})
        return {"tokens": tokens, "wall_s": wall,
                "prompt_s": timings.get("prompt_ms", 0.0) / 1e3,
                "drafted": timings.get("draft_n"), "accepted": timings.get("draft_n_accepted")}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- specdec -------------------------------------------------------------------------------------
SPECDEC = {
    # name: (drafter, options, k) on the llama.cpp verifier
    "specdec llama.cpp: target alone": (None, None, None),
    "specdec llama.cpp: default (model + lookup, -k auto)": ("model", DrafterOptions(), "auto"),
    "specdec llama.cpp: model k=2": ("model", DrafterOptions(lookup=False), 2),
    "specdec llama.cpp: prompt lookup, -k auto": ("prompt-lookup", DrafterOptions(), "auto"),
}
FAST = {  # on a second verifier with --kernels fast
    "specdec llama.cpp fast kernels: target alone": (None, None, None),
    "specdec llama.cpp fast kernels: default (model + lookup, -k auto)": (
        "model", DrafterOptions(), "auto"),
}
INT8 = {  # on a verifier with --engine int8 (the converted folder of the same short name)
    "specdec int8: target alone": (None, None, None),
    "specdec int8: default (model + lookup, -k auto)": ("model", DrafterOptions(), "auto"),
    "specdec int8: prompt lookup, -k auto": ("prompt-lookup", DrafterOptions(), "auto"),
}
W4A8 = {  # on a verifier with --engine w4a8 (the default on a CPU: the same GGUF file)
    "specdec w4a8: target alone": (None, None, None),
    "specdec w4a8: default (model + lookup, -k auto)": ("model", DrafterOptions(), "auto"),
    "specdec w4a8: prompt lookup, -k auto": ("prompt-lookup", DrafterOptions(), "auto"),
}
CONCURRENT = "specdec llama.cpp: default, {n} concurrent sessions"
# the targets alone whose greedy outputs the quality table compares, and the references
QUALITY = {"specdec int8: target alone": "int8", "llama-server: target alone": "Q4_K_M",
           "specdec transformers: target alone": "bf16"}


def own_alone(system: str) -> str:
    """The target-alone system a system's greedy output must equal."""
    if system.startswith("llama-server"):
        return "llama-server: target alone"
    for prefix in ("specdec llama.cpp fast kernels", "specdec transformers", "specdec int8",
                   "specdec w4a8"):
        if system.startswith(prefix):
            return f"{prefix}: target alone"
    return "specdec llama.cpp: target alone"


def specdec_run(client: SpecDecClient, ids: list[int], max_new: int, k: int | str | None,
                alone: bool) -> dict[str, Any]:
    started = time.perf_counter()
    result = (client.baseline(ids, max_new_tokens=max_new) if alone
              else client.generate(ids, num_draft_tokens=k, max_new_tokens=max_new))
    wall = time.perf_counter() - started
    m = result.metrics
    return {"tokens": result.token_ids, "wall_s": wall,
            "drafted": getattr(m, "drafted_tokens", None),
            "accepted": getattr(m, "accepted_tokens", None),
            "calls": getattr(m, "verify_calls", None),
            "draft_lengths": dict(getattr(m, "draft_lengths", {}))}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two greedy outputs differ (None: equal as far as the
    shorter goes)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a .gguf file or a short name of the offline pair")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--kv-budget-tokens", type=int, default=16384,
                        help="each verifier's KV budget: 4 sessions of 4096 tokens")
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                        help="also today's transformers engine (bf16 folders of the same "
                        "short names): target alone and the default client setting")
    parser.add_argument("--two-host", action=argparse.BooleanOptionalAction, default=True,
                        help="the two-host simulation: verifier and client pinned to "
                        "different cores, one thread each, 0 / 20 / 100 ms added round trip")
    parser.add_argument("--rtts", type=float, nargs="+", default=[0.0, 20.0, 100.0])
    parser.add_argument("--w4a8", action=argparse.BooleanOptionalAction, default=True,
                        help="also specdec on the w4a8 engine (--engine w4a8, the same GGUF "
                        "file; the default engine on a CPU)")
    parser.add_argument("--two-host-engines", nargs="+", choices=["llama-cpp", "int8", "w4a8"],
                        default=["llama-cpp"], help="the verifiers of the two-host simulation "
                        "(int8: the converted folder of --target's short name)")
    parser.add_argument("--fast-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="also a verifier with --kernels fast: its target alone and the "
                        "default client")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                        help="also specdec on the int8 engine (--engine int8, the converted "
                        "folder of the same short name): target alone, default, prompt "
                        "lookup; and how often its greedy output matches bf16's and the "
                        "Q4_K_M file's")
    parser.add_argument("--concurrent", type=int, default=4,
                        help="default clients at once on the exact verifier, each output "
                        "checked against the same prompt alone (0: skip)")
    parser.add_argument("--out", default="bench_results/llama.json")


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """A workload prompt's token ids: through the chat template where the prompt is a chat
    turn and the tokenizer has one (a base model takes the text as it is)."""
    if prompt.chat and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True,
            tokenize=True, return_dict=False))
    return list(tokenizer(prompt.text)["input_ids"])


def gguf_of(spec: str) -> Path:
    return fetch_gguf(spec) if spec in OFFLINE_MODELS else Path(spec)


def run(args: argparse.Namespace) -> dict[str, Any]:
    target, drafter = gguf_of(args.target), gguf_of(args.drafter)
    tokenizer = load_tokenizer(args.target if args.target in OFFLINE_MODELS else str(target))
    prompts = {name: items for name, items in workloads(args.prompts).items()
               if name in args.workloads}
    ids_of = functools.partial(prompt_ids, tokenizer)

    binary = llama_server_binary()
    peers = peer_modes(drafter, args.threads)
    records: list[dict[str, Any]] = []
    servers: dict[str, LlamaServer] = {}
    layouts = extra_buffer_types()  # llama.cpp's repacked weight layouts, and AMX's fate here
    engine: dict[str, Any] = {"extra_layouts": layouts, "amx_works": (
        amx_works(str(target), args.threads) if "AMX" in layouts else None)}
    verifier = VerifierProcess(["--model", str(target), "--engine", "llama-cpp",
                                "--kv-budget-tokens", str(args.kv_budget_tokens),
                                "--max-context", "4096"], threads=args.threads)
    fast_verifier = VerifierProcess(["--model", str(target), "--engine", "llama-cpp",
                                     "--kernels", "fast",
                                     "--kv-budget-tokens", str(args.kv_budget_tokens),
                                     "--max-context", "4096"], threads=args.threads)
    hf_verifier = VerifierProcess(["--model", args.target, "--engine", "transformers",
                                   "--kv-budget-tokens", str(args.kv_budget_tokens),
                                   "--max-context", "4096"], threads=args.threads)
    int8_verifier = VerifierProcess(["--model", args.target, "--engine", "int8",
                                     "--kv-budget-tokens", str(args.kv_budget_tokens),
                                     "--max-context", "4096"], threads=args.threads)
    w4a8_verifier = VerifierProcess(["--model", str(target), "--engine", "w4a8",
                                     "--kv-budget-tokens", str(args.kv_budget_tokens),
                                     "--max-context", "4096"], threads=args.threads)
    try:
        for name, extra in peers.items():
            servers[name] = LlamaServer(binary, target, args.threads, extra)
        verifier.start()
        clients: dict[str, tuple[SpecDecClient, Any, bool]] = {}
        if args.transformers and args.target in OFFLINE_MODELS:
            fetch_offline_models(args.target, args.drafter)
            hf_verifier.start()
            clients["specdec transformers: target alone"] = (
                SpecDecClient(hf_verifier.url, None, tokenizer=tokenizer), None, True)
            clients["specdec transformers: default (model + lookup, -k auto)"] = (
                SpecDecClient(hf_verifier.url, args.drafter,
                              options=DrafterOptions(engine="transformers")), "auto", False)
        systems = [(verifier, SPECDEC)]
        if args.fast_kernels:
            fast_verifier.start()
            systems.append((fast_verifier, FAST))
        if args.int8 and args.target in OFFLINE_MODELS:
            fetch_offline_models(args.target)
            int8_verifier.start()
            systems.append((int8_verifier, INT8))
        if args.w4a8:
            w4a8_verifier.start()
            systems.append((w4a8_verifier, W4A8))
        for process, table in systems:
            for name, (kind, options, k) in table.items():
                if kind is None:
                    clients[name] = (SpecDecClient(process.url, None, tokenizer=tokenizer), k,
                                     True)
                    info = clients[name][0].info  # verify costs timed at its start
                    engine[name] = {"verify_ms": info.verify_ms, "kernels": info.kernels}
                else:
                    spec = str(drafter) if kind == "model" else kind
                    opts = DrafterOptions(**{**(options or DrafterOptions()).__dict__,
                                             "engine": "llama-cpp", "threads": args.threads})
                    clients[name] = (SpecDecClient(process.url, spec, tokenizer=tokenizer,
                                                   options=opts), k, False)
        for round_no in range(args.rounds):
            for workload, items in prompts.items():
                for prompt in items:
                    ids = ids_of(prompt)
                    for name, server in servers.items():
                        out = server.generate(ids, args.max_new_tokens)
                        records.append({"round": round_no, "workload": workload,
                                        "prompt": prompt.name, "system": name, **out})
                    for name, (client, k, alone) in clients.items():
                        out = specdec_run(client, ids, args.max_new_tokens, k, alone)
                        records.append({"round": round_no, "workload": workload,
                                        "prompt": prompt.name, "system": name, **out})
                    print(f"round {round_no} {prompt.name}: done", flush=True)
        if args.concurrent:
            records += concurrent_runs(args, verifier.url, drafter, tokenizer, prompts, ids_of)
    finally:
        for server in servers.values():
            server.close()
        verifier.stop()
        fast_verifier.stop()
        hf_verifier.stop()
        int8_verifier.stop()
        w4a8_verifier.stop()
    two_host = two_host_runs(args, binary, target, drafter, tokenizer, prompts, ids_of) \
        if args.two_host else []
    return report(records, args, two_host, engine)


def concurrent_runs(args: argparse.Namespace, url: str, drafter: Path, tokenizer: Any,
                    prompts: dict[str, list[Any]], ids_of: Any) -> list[dict[str, Any]]:
    """``args.concurrent`` default clients at once (a llama.cpp drafter of one thread each, on
    the verifier's cores), the workload's prompts cycled among them, every round."""
    n = args.concurrent
    clients = [SpecDecClient(url, str(drafter), tokenizer=tokenizer,
                             options=DrafterOptions(engine="llama-cpp", threads=1))
               for _ in range(n)]
    records: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        for workload, items in prompts.items():
            outs, wall = at_once([
                functools.partial(specdec_run, clients[j], ids_of(items[j % len(items)]),
                                  args.max_new_tokens, "auto", False) for j in range(n)])
            for j, out in enumerate(outs):
                records.append({"round": round_no, "workload": workload,
                                "prompt": items[j % len(items)].name,
                                "system": CONCURRENT.format(n=n), "batch_wall_s": wall, **out})
            print(f"round {round_no} {workload}: {n} concurrent done", flush=True)
    return records


def two_host_runs(args: argparse.Namespace, binary: Path, target: Path, drafter: Path,
                  tokenizer: Any, prompts: dict[str, list[Any]], ids_of: Any,
                  ) -> list[dict[str, Any]]:
    """Verifier on core 0, client (this process) on core 1, one thread each, an added round
    trip per call; the peer is llama-server's target alone on core 0 with one thread."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("two-host simulation skipped: needs 2 cores")
        return []
    server_core, client_core = str(cores[0]), {cores[1]}
    records: list[dict[str, Any]] = []
    peer = LlamaServer(binary, target, 1, [], pin=server_core)
    models = {"llama-cpp": ("llama.cpp", str(target)), "int8": ("int8", args.target),
              "w4a8": ("w4a8", str(target))}
    verifiers = []
    saved = os.sched_getaffinity(0)
    try:
        clients = {}
        for engine in args.two_host_engines:  # all loaded at once: idle ones cost nothing
            label, model = models[engine]
            verifier = VerifierProcess(["--model", model, "--engine", engine,
                                        "--kv-budget-tokens", str(args.kv_budget_tokens),
                                        "--max-context", "4096"], threads=1)
            verifier.prefix = ["taskset", "-c", server_core]
            verifiers.append(verifier)
            verifier.start()
            for rtt in args.rtts:
                for overlap in (False, True):
                    name = (f"specdec {label} default, rtt {rtt:g} ms"
                            + (", overlap" if overlap else ""))
                    clients[name] = (rtt, verifier.url, overlap)
        os.sched_setaffinity(0, client_core)
        made = {name: (rtt, SpecDecClient(url, str(drafter), tokenizer=tokenizer,
                                          simulated_rtt_ms=rtt, options=DrafterOptions(
                                              engine="llama-cpp", threads=1, overlap=overlap)))
                for name, (rtt, url, overlap) in clients.items()}
        for workload, items in prompts.items():
            for prompt in items[:1]:
                ids = ids_of(prompt)
                out = peer.generate(ids, args.max_new_tokens)
                records.append({"workload": workload, "prompt": prompt.name, "rtt_ms": 0.0,
                                "system": "llama-server: target alone, 1 core", **out})
                for name, (rtt, client) in made.items():
                    out = specdec_run(client, ids, args.max_new_tokens, "auto", False)
                    records.append({"workload": workload, "prompt": prompt.name,
                                    "rtt_ms": rtt, "system": name, **out})
                print(f"two-host {prompt.name}: done", flush=True)
    finally:
        os.sched_setaffinity(0, saved)
        peer.close()
        for verifier in verifiers:
            verifier.stop()
    return records


def quality(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """How often each quantization's greedy output (the targets alone in :data:`QUALITY`)
    matches another's over the benchmark prompts (first round), and where the first
    difference falls: the int8 engine next to the Q4_K_M file, both against bf16."""
    first = {(r["system"], r["prompt"]): r["tokens"] for r in records
             if r.get("round") == 0 and r["system"] in QUALITY}
    prompts = list(dict.fromkeys(prompt for _, prompt in first))
    rows = []
    names = list(QUALITY)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs = [(first[(a, p)], first[(b, p)]) for p in prompts
                     if (a, p) in first and (b, p) in first]
            if not pairs:
                continue
            diffs = [first_difference(x, y) for x, y in pairs]
            rows.append({"pair": f"{QUALITY[a]} vs {QUALITY[b]}",
                         "same": f"{diffs.count(None)}/{len(pairs)}",
                         "first_differences": sorted(d for d in diffs if d is not None)})
    table = markdown_table(rows, [("pair", "greedy outputs"), ("same", "identical"),
                                  ("first_differences", "first differing token (others)")])
    return rows, table


def report(records: list[dict[str, Any]], args: argparse.Namespace,
           two_host: list[dict[str, Any]] | None = None,
           engine: dict[str, Any] | None = None) -> dict[str, Any]:
    for r in records:
        r["tok_s"] = len(r["tokens"]) / r["wall_s"] if r["wall_s"] else 0.0
    alone = "llama-server: target alone"
    reference = {(r["round"], r["prompt"], r["system"]): r for r in records
                 if r["system"].endswith("target alone")}
    for r in records:
        ref = reference[(r["round"], r["prompt"], alone)]
        r["vs_llama_server"] = r["tok_s"] / ref["tok_s"] if ref["tok_s"] else None
        own = reference.get((r["round"], r["prompt"], own_alone(r["system"])))
        r["first_difference"] = first_difference(r["tokens"], own["tokens"]) if own else None
        r["checked_against"] = own_alone(r["system"]) if own else None
    rows = []
    systems = list(dict.fromkeys(r["system"] for r in records))
    for workload in args.workloads:
        for system in systems:
            mine = [r for r in records if r["workload"] == workload and r["system"] == system]
            if not mine:
                continue
            diffs = [r["first_difference"] for r in mine if r["first_difference"] is not None]
            rows.append({
                "workload": workload, "system": system,
                "tok_s": statistics.median(r["tok_s"] for r in mine),
                "vs_llama_server": statistics.median(r["vs_llama_server"] for r in mine),
                "same_as_alone": f"{len(mine) - len(diffs)}/{len(mine)}",
                "first_difference": min(diffs) if diffs else None})
    table = markdown_table(rows, [
        ("workload", "workload"), ("system", "system"), ("tok_s", "tok/s (median; concurrent: "
                                                         "per session)"),
        ("vs_llama_server", "vs llama-server alone (median)"),
        ("same_as_alone", "output = its target alone's"),
        ("first_difference", "first differing token")])
    print(table)
    two_host_rows = []
    for r in two_host or []:
        r["tok_s"] = len(r["tokens"]) / r["wall_s"] if r["wall_s"] else 0.0
    for workload in args.workloads:
        mine = [r for r in two_host or [] if r["workload"] == workload]
        base = next((r for r in mine if r["system"].startswith("llama-server")), None)
        for r in mine:
            two_host_rows.append({
                "workload": workload, "system": r["system"], "tok_s": r["tok_s"],
                "vs_one_core": r["tok_s"] / base["tok_s"] if base and base["tok_s"] else None,
                "acceptance": (r["accepted"] / r["drafted"]) if r.get("drafted") else None})
    two_host_table = markdown_table(two_host_rows, [
        ("workload", "workload"), ("system", "system"), ("tok_s", "tok/s"),
        ("vs_one_core", "vs llama-server alone on 1 core"), ("acceptance", "acceptance")])
    if two_host_rows:
        print(two_host_table)
    quality_rows, quality_table = quality(records)
    if quality_rows:
        print(quality_table)
    payload = {"command": " ".join(["python -m scripts.bench llama", *sys.argv[2:]]),
               "machine": {"cpus": os.cpu_count(), "threads": args.threads,
                           "target": args.target, "drafter": args.drafter,
                           "max_new_tokens": args.max_new_tokens, "llama_cpp": engine or {}},
               "rows": rows, "runs": records, "table": table,
               "two_host_rows": two_host_rows, "two_host_runs": two_host or [],
               "two_host_table": two_host_table, "quality_rows": quality_rows,
               "quality_table": quality_table}
    write_json(args.out, payload)
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run(parser.parse_args())
