"""Grammar engines side by side: the allowed-token mask of JSON-schema output, per token.

Which engine computes a full-vocabulary mask fastest on Qwen2.5's tokenizer (151,936 ids), at
what compile cost: llguidance (``shared.protocol.grammar``), xgrammar and
outlines-core. On each schema (a flat object with an enum, a nested one with an array of
objects, any object) every engine walks the same token ids - a valid answer, then EOS - filling
one preallocated int32 bitmask before each token, then advancing by it; each mask must allow
the answer's token. Per position the median over rounds, then the median and p95 over
positions. Engines alternate order by round (ABC, CBA, ...); everything runs on one thread. An
engine not installed is reported, not fatal (the project's .venv has llguidance alone; the
other two go into a venv of their own, ``--no-deps``: xgrammar's metadata asks for triton,
which its CPU path never imports):

    .venv/bin/python -m venv /tmp/gvenv
    /tmp/gvenv/bin/pip install torch==2.13.0 transformers numpy pydantic httpx \
        apache-tvm-ffi llguidance==1.9.1
    /tmp/gvenv/bin/pip install --no-deps xgrammar==0.2.9 outlines-core==0.2.14
    /tmp/gvenv/bin/python -m scripts.bench grammar --rounds 5 --out docs/benchmarks/grammar.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import numpy as np

from scripts.bench.common import markdown_table, write_json
from shared.machine_cache import specdec_home

TOKENIZER = str(specdec_home() / "models" / "qwen2.5-coder-0.5b")  # python -m shared.models.fetch
ROLLBACK = 4  # tokens undone by the rollback check


def _closed(**properties: Any) -> dict[str, Any]:
    """An object with exactly these properties, each required (alike in every engine)."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


_S, _I, _N = {"type": "string"}, {"type": "integer"}, {"type": "number"}
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {  # name: (schema, a valid answer)
    "flat": (_closed(name=_S, age=_I, score=_N, active={"type": "boolean"},
                     role={"enum": ["admin", "user", "guest"]}),
             {"name": "Ada Lovelace", "age": 36, "score": 9.5, "active": True, "role": "user"}),
    "nested": (_closed(order=_S, customer=_closed(name=_S, email=_S),
                       items={"type": "array", "minItems": 1,
                              "items": _closed(sku=_S, qty=_I, price=_N)}),
               {"order": "A-1042", "customer": {"name": "Grace Hopper", "email": "gh@navy.mil"},
                "items": [{"sku": "KB-87", "qty": 2, "price": 49.9},
                          {"sku": "MS-3", "qty": 1, "price": 19.0}]}),
    "any-object": ({"type": "object"}, {"id": 7, "tags": ["alpha", "beta"],
                                        "meta": {"ok": True, "ratio": 0.25, "note": None}}),
}


@dataclass
class Engine:  # one engine, by ENGINES' name (its distribution's)
    setup_s: float  # tokenizer info, built once
    threads: str
    rollback_how: str
    compile: Callable[[dict[str, Any]], Any]  # schema -> a matcher at the start
    fill: Callable[[Any, np.ndarray], None]  # the mask into the [1, words] int32 buffer
    advance: Callable[[Any, int], bool]
    rollback: Callable[[Any, int], None]


def _llguidance(tokenizer: Any, n_vocab: int, eos: int) -> Engine:
    import llguidance
    import llguidance.hf

    started = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    setup = time.perf_counter() - started

    def compile_(schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    return Engine(setup, "1 (a single matcher's mask runs on the caller's thread)",
           "LLMatcher.rollback(n): any consumed tokens",
           compile_, lambda m, buf: m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes),
           lambda m, t: bool(m.consume_token(t)), lambda m, n: m.rollback(n))


def _xgrammar(tokenizer: Any, n_vocab: int, eos: int) -> Engine:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=n_vocab, stop_token_ids=[eos])
    setup = time.perf_counter() - started
    # no cache, so that every round's compile is cold; one thread (its default is 8)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_(schema: dict[str, Any]) -> Any:
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    return Engine(setup, "1 (GrammarCompiler(max_threads=1); a single matcher's mask is serial)",
           "GrammarMatcher.rollback(n): up to max_rollback_tokens (default unlimited)",
           compile_, lambda m, buf: m.fill_next_token_bitmask(buf),
           lambda m, t: bool(m.accept_token(t)), lambda m, n: m.rollback(n))


def _byte_level(tokenizer: Any, eos: int) -> dict[bytes, list[int]]:
    """Every id but EOS by its bytes: outlines-core takes bytes, Qwen's vocabulary holds GPT-2's
    byte-to-character stand-ins (added tokens excepted, which are their text)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_in = {chr(b): b for b in printable}
    stand_in.update({chr(256 + i): b for i, b in
                     enumerate(b for b in range(256) if b not in printable)})
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    out: dict[bytes, list[int]] = {}
    for text, i in tokenizer.get_vocab().items():
        if i != eos:
            key = text.encode() if text in added else bytes(stand_in[c] for c in text)
            out.setdefault(key, []).append(i)
    return out


def _outlines(tokenizer: Any, n_vocab: int, eos: int) -> Engine:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    # Vocabulary.from_pretrained would ask the hub; built from the local tokenizer instead
    started = time.perf_counter()
    vocabulary = oc.Vocabulary(eos, _byte_level(tokenizer, eos))
    setup = time.perf_counter() - started

    def advance(guide: Any, token: int) -> bool:
        if token == eos and guide.is_finished():
            return True  # its masks allow EOS in a final state, but the Index has no edge for it
        try:
            guide.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    return Engine(setup, "1 (Index construction and masks are serial Rust)",
           "Guide(index, max_rollback=32).rollback_state(n): its last max_rollback states",
           lambda s: oc.Guide(oc.Index(build_regex_from_schema(json.dumps(s)), vocabulary),
                              max_rollback=32),
           lambda g, buf: g.write_mask_into(buf.ctypes.data, buf.size, 4),
           advance, lambda g, n: g.rollback_state(n))


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def rollback_check(engine: Engine, matcher: Any, buf: np.ndarray, earlier: np.ndarray,
                   redo: list[int]) -> bool | str:
    """Undo ``redo`` (the last tokens): is the mask the one computed before them? Then redo."""
    try:
        engine.rollback(matcher, len(redo))
        buf.fill(0)
        engine.fill(matcher, buf)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"{type(exc).__name__}: {exc}"
    same = bool(np.array_equal(buf, earlier))
    for token in redo:
        engine.advance(matcher, token)
    return same


def walk(engine: Engine, schema: dict[str, Any], tokens: list[int],
         words: int) -> dict[str, Any]:
    """One cold compile and one pass over ``tokens``: times, masks, and the rollback check."""
    started = time.perf_counter()
    try:
        matcher = engine.compile(schema)
    except Exception as exc:  # noqa: BLE001 - a schema it cannot compile is a result
        return {"error": f"does not compile: {type(exc).__name__}: {exc}"}
    compile_s = time.perf_counter() - started
    buf = np.zeros((1, words), dtype=np.int32)
    mask_ns: list[int] = []
    advance_ns: list[int] = []
    masks: list[np.ndarray] = []
    refused, error = 0, None
    rollback_ok: bool | str = False
    for i, token in enumerate(tokens):
        if i == len(tokens) - 1 >= ROLLBACK:  # untimed, before EOS (which may stop an engine)
            rollback_ok = rollback_check(engine, matcher, buf, masks[i - ROLLBACK],
                                         tokens[i - ROLLBACK:i])
        buf.fill(0)  # so that a mask an engine left partly unwritten cannot pass
        t0 = time.perf_counter_ns()
        engine.fill(matcher, buf)
        t1 = time.perf_counter_ns()
        ok = engine.advance(matcher, token)
        t2 = time.perf_counter_ns()
        mask_ns.append(t1 - t0)
        advance_ns.append(t2 - t1)
        masks.append(buf.copy())
        refused += not (int(buf[0, token >> 5]) >> (token & 31)) & 1
        if not ok:
            error = f"advance refused token {token} at position {i}"
            break
    return {"compile_s": compile_s, "mask_ns": mask_ns, "advance_ns": advance_ns,
            "masks": masks, "refused": refused, "error": error, "rollback_ok": rollback_ok}


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = re.search(r"Model name:\s*(.+)", lscpu)
    flags = re.search(r"Flags:\s*(.+)", lscpu)
    return {"cpu": model.group(1).strip() if model else platform.processor(),
            "flags": sorted(f for f in (flags.group(1).split() if flags else [])
                            if f.startswith(("avx512", "amx", "avx2"))),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default=TOKENIZER, help="a Hugging Face tokenizer folder")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="mask width (default: the tokenizer's length, 151936 for Qwen2.5)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--schemas", nargs="+", default=list(SCHEMAS), choices=list(SCHEMAS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_results/grammar.json")


def summary(done: list[dict[str, Any]], reference: list[np.ndarray] | None) -> dict[str, Any]:
    """One engine on one schema over the rounds: per position the median over rounds, then the
    median and p95 over positions (the first position alone too: some engines build lazily)."""
    n = min(len(r["mask_ns"]) for r in done)
    mask_us = np.median([r["mask_ns"][:n] for r in done], axis=0) / 1e3
    advance_us = np.median([r["advance_ns"][:n] for r in done], axis=0) / 1e3
    first = done[0]
    return {
        "compile_ms": round(float(np.median([r["compile_s"] for r in done])) * 1e3, 2),
        "first_mask_us": round(float(mask_us[0]), 1),
        "mask_p50_us": round(float(np.median(mask_us)), 1),
        "mask_p95_us": round(float(np.percentile(mask_us, 95)), 1),
        "advance_p50_us": round(float(np.median(advance_us)), 2),
        "allowed_mean": round(float(np.mean([np.unpackbits(m.view(np.uint8)).sum()
                                             for m in first["masks"]])), 1),
        "refused": max(r["refused"] for r in done),
        "same_as_llguidance": None if reference is None else sum(
            np.array_equal(a, b) for a, b in zip(first["masks"], reference, strict=False)),
        "rollback_ok": first["rollback_ok"], "error": first["error"]}


COLUMNS = [("schema", "schema"), ("engine", "engine"), ("tokens", "tokens"),
           ("compile_ms", "compile ms"), ("first_mask_us", "1st mask µs"),
           ("mask_p50_us", "mask p50 µs"), ("mask_p95_us", "mask p95 µs"),
           ("advance_p50_us", "advance p50 µs"), ("allowed_mean", "allowed (mean)"),
           ("refused", "answer tokens refused"), ("same_as_llguidance", "masks = llguidance"),
           ("rollback_ok", f"rollback {ROLLBACK} ok"), ("error", "error")]


def run(args: argparse.Namespace) -> dict[str, Any]:
    # before any engine loads: llguidance's and tokenizers' pools stay at one thread
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    n_vocab = args.vocab_size or len(tokenizer)
    words, eos = (n_vocab + 31) // 32, int(tokenizer.eos_token_id)
    engines: dict[str, Engine] = {}
    about: list[dict[str, Any]] = []
    for name in args.engines:
        try:
            e = engines[name] = ENGINES[name](tokenizer, n_vocab, eos)
            about.append({"engine": name, "version": version(name), "threads": e.threads,
                          "tokenizer_info_s": round(e.setup_s, 3), "rollback": e.rollback_how})
        except Exception as exc:  # noqa: BLE001 - an engine absent or broken is a result
            about.append({"engine": name, "error": f"{type(exc).__name__}: {exc}"})
    answers = {s: tokenizer.encode(json.dumps(SCHEMAS[s][1]), add_special_tokens=False) + [eos]
               for s in args.schemas}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for schema in args.schemas:
            for name in order:
                done = runs.setdefault((schema, name), [])
                if not done or "masks" in done[0]:  # one that did not compile is not retried
                    done.append(walk(engines[name], SCHEMAS[schema][0], answers[schema], words))
    rows = []
    for schema in args.schemas:
        reference = runs.get((schema, "llguidance"), [{}])[0].get("masks")
        for name in engines:
            done = runs[(schema, name)]
            rows.append({"schema": schema, "engine": name, "tokens": len(answers[schema]),
                         **(summary(done, reference) if "masks" in done[0] else done[0])})
    print(markdown_table(rows, COLUMNS) + "\n")
    print(markdown_table(about, [(k, k.replace("_", " ")) for k in (
        "engine", "version", "tokenizer_info_s", "threads", "rollback", "error")]))
    payload = {"command": getattr(args, "command_line", "python -m scripts.bench grammar"),
               "machine": {**machine(), "numpy": np.__version__,
                           "transformers": version("transformers")},
               "tokenizer": args.tokenizer, "vocab_size": n_vocab, "rounds": args.rounds,
               "schemas": {s: {"schema": SCHEMAS[s][0], "answer": json.dumps(SCHEMAS[s][1]),
                               "tokens": answers[s]} for s in args.schemas},
               "engines": about, "rows": rows}
    write_json(args.out, payload)
    return payload
