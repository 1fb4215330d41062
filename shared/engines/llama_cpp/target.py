"""The llama.cpp engine: a GGUF target served through ``shared/engines/llama_cpp/runtime.py``.

A session's slot is a llama.cpp sequence. A batch of steps is ONE ``llama_decode`` over every
step's new tokens (prefills included), with logits only at the positions a verify block decides
from; a block's rejected drafts are dropped from the sequence when its next tokens are written
(``LlamaModel.decode`` removes the positions it rewrites).

``kernels="exact"`` (the default) computes every row of a decode as a one-token step computes
it, so greedy speculation equals the target alone's token for token, at any k and under any
load (``LlamaModel``'s ``exact``: one KV stream per slot, prompts decoded alone in whole
batches cut at fixed positions, every row at most three per ``llama_decode``, in a llama.cpp
built without llamafile).
``kernels="fast"`` gives llama.cpp whole batches (a KV stream per slot, as ``llama-server -np
N`` lays them out): cheaper blocks and batches of four rows and more, but their rows round
unlike one-token steps (docs/design.md, "Exact greedy on llama.cpp").
Acceptance is the same code as on the transformers engines (``BatchForward.run``), on the rows
llama.cpp returns. Token trees are not verified here (``trees = False``: the validator answers
422 ``tree_unsupported``); beam search reorders sequences by saving and restoring their states
(a stream cannot share cells).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from shared.engines.llama_cpp.runtime import (
    GGUFWeights,
    LlamaModel,
    Segment,
    cost_key,
    exact_kernels,
    extra_buffer_types,
    resolve_gguf,
)
from shared.engines.target import (
    BatchForward,
    ForwardItem,
    ModelInfo,
    PoolSlots,
    SlotAllocator,
)
from shared.models.catalog import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)
MAX_SLOTS = 256  # llama.cpp's LLAMA_MAX_SEQ: a context holds at most 256 sequences
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 8: "q5_0", 9: "q5_1",
              10: "q2_k", 12: "q3_k_m", 14: "q4_k_s", 15: "q4_k_m", 16: "q5_k_s", 17: "q5_k_m",
              18: "q6_k", 32: "bf16"}


def eos_ids(model: LlamaModel, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS and the file's own EOS / EOT ids (the ids transformers' engine
    stops on for the same model; llama.cpp's wider end-of-generation set, FIM tokens
    included, is not used)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = model.meta(key)
        if value is not None and value.isdigit() and int(value) < model.vocab_size:
            ids.add(int(value))
    return sorted(ids)


class LlamaCppEngine(PoolSlots, BatchForward):
    """A GGUF target on llama.cpp, one sequence per session."""

    trees = False

    def __init__(self, model: LlamaModel, tokenizer: Any, name: str, num_slots: int,
                 acceptance: str = "device", kernels: str = "fast") -> None:
        self.model = model
        self.acceptance = acceptance
        self.tokenizer = tokenizer
        self.pool = SlotAllocator(num_slots, model.seq_tokens)
        file_type = model.meta("general.file_type")
        kind = FILE_TYPES.get(int(file_type), "gguf") if file_type and file_type.isdigit() \
            else "gguf"
        self.info = ModelInfo(
            name=name, vocab_size=model.vocab_size, eos_token_ids=eos_ids(model, tokenizer),
            fingerprint=tokenizer_fingerprint(tokenizer), max_context=model.seq_tokens,
            model_limit=model.model_limit, dtype=kind, device="cpu", kernels=kernels,
            tokenizer=tokenizer)

    # -- slots (``pool``: their ids; every sequence may fill its share of the cells)
    @property
    def nbytes(self) -> int:
        return self.model.nbytes

    def release(self, slot: int) -> None:
        self.model.remove(slot)
        self.pool.release(slot)

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        if parents == list(range(len(slots))):
            return
        # a stream copies whole: save each parent, restore its children
        states = {parent: self.model.save(slots[parent]) for parent in set(parents)}
        for child, (slot, parent) in enumerate(zip(slots, parents, strict=True)):
            if parent != child:
                self.model.restore(slot, states[parent])
                self.model.remove(slot, length)

    def counters(self) -> dict[str, int]:
        return {"llama_forwards": self.model.forwards, "llama_decodes": self.model.decodes}

    # -- model operations
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        if any(item.encoder_ids is not None or item.tree_parents for item in items):
            raise ValueError("the llama-cpp engine runs causal chains only")
        rows = self.model.decode([
            Segment(item.slot, item.start, item.token_ids,
                    item.keep_from if item.keep_logits else None, item.steps_from)
            for item in items])
        return [None if block is None else torch.from_numpy(block) for block in rows]

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        raise ValueError("the llama-cpp engine does not verify trees")

    def warm_up(self) -> None:
        """One small decode (buffers allocated before the first client), then the verify
        costs that ``/v1/info`` reports."""
        self.warm_up_and_time(f"llama.cpp|{cost_key(self.model)}")


def load_llama_engine(spec: str, max_context: int, kv_budget_tokens: int, threads: int,
                      max_batch_tokens: int, acceptance: str, kernels: str) -> LlamaCppEngine:
    """A GGUF target on llama.cpp: slots of ``max_context`` tokens (0: the model's context),
    as many as ``kv_budget_tokens`` holds; ``kernels``: "exact" (one-row kernels, a KV stream
    per slot) or "fast" (llama.cpp's whole-batch kernels, also a KV stream per slot)."""
    started = time.perf_counter()
    path, tokenizer_spec = resolve_gguf(spec)
    exact = kernels == "exact"
    # AMX's kernels are not known to compute a row alone at any row count: exact keeps them off
    weights = GGUFWeights(path, threads, plain=exact and "AMX" in extra_buffer_types())
    limit = weights.model_limit
    context = min(max_context or limit, limit, kv_budget_tokens)
    num_slots = max(1, min(kv_budget_tokens // context, MAX_SLOTS))
    model = LlamaModel(weights, n_seqs=num_slots, seq_tokens=context, threads=threads,
                       batch_tokens=max(max_batch_tokens, 512), exact=exact, streams=True)
    described = kernels
    if exact:
        holds, why = exact_kernels()
        if not holds:
            log.warning("kernels=exact asked, but greedy output may differ from the target "
                        "alone's here: %s", why)
            described = f"inexact: {why}"
    engine = LlamaCppEngine(model, load_tokenizer(tokenizer_spec), spec, num_slots, acceptance,
                            described)
    engine.warm_up()
    log.info("loaded target %s on llama.cpp (%s, %s kernels, %d threads): %d slots x %d tokens "
             "(%.0f MiB of KV) in %.1f s", path, engine.info.dtype, kernels, model.threads,
             num_slots, context, model.nbytes / 2**20, time.perf_counter() - started)
    return engine
