"""The int8 engine's target: :class:`~shared.engines.int8.model.Int8Decoder` behind the
verifier's engine interface, a session per KV slot.

A batch of steps is one forward over every step's new tokens; only the rows a verify block
decides from become logits. Rejected drafts need no cleanup: a slot's positions past its
accepted prefix are overwritten by the next block, and attention reads a row's prefix only.

A forward's rows go through the decoder :data:`CHUNK_ROWS` at a time, so a long prompt (a
scheduler admits its first job whole, however long) takes the activations of that many rows,
not of all its tokens: every row is computed as a one-token step computes it, whatever rows
sit beside it, so chunks change no bit of any row or of the keys and values it writes.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import gc
import logging
import time
from typing import Any

import torch

from shared.engines import DEFAULT_KV_BUDGET
from shared.engines.int8 import Int8Options
from shared.engines.int8.kernels import activation_bits, quantized_engine
from shared.engines.int8.model import (
    Int8Decoder,
    Rows,
    checkpoint_tensor_names,
    refuse_unread,
    shape_of,
)
from shared.engines.target import (
    BatchForward,
    ForwardItem,
    ModelInfo,
    PoolSlots,
    SlotAllocator,
    TargetOptions,
)
from shared.engines.transformers.dtype_choice import cache_key
from shared.engines.transformers.models import eos_ids_of
from shared.models.catalog import (
    load_causal_lm,
    load_tokenizer,
    resolve_model_spec,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

# Rows through the decoder at once. The activations of a row of Qwen2.5-1.5B take ~0.3 MB at
# their peak (the MLP's 2 x 8,960 floats and what follows from them), so 256 rows hold ~75 MB
# where a 16k-token prompt in one piece took 4.6 GB; each chunk reads the weights once more,
# a one-token step's worth, against 256 rows' work (docs/reliability.md).
CHUNK_ROWS = 256


class Int8Engine(PoolSlots, BatchForward):
    """A decoder-only target in int8 on the CPU, every row computed as a one-token step."""

    trees = False
    chunk_rows = CHUNK_ROWS

    def __init__(self, decoder: Int8Decoder, tokenizer: Any, eos_token_ids: list[int],
                 name: str, num_slots: int, acceptance: str = "device") -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.acceptance = acceptance
        self.pool = SlotAllocator(num_slots, decoder.slot_tokens)
        self.forwards = 0
        shape = decoder.shape
        self.info = ModelInfo(
            name=name, vocab_size=shape.vocab, eos_token_ids=eos_token_ids,
            fingerprint=tokenizer_fingerprint(tokenizer), max_context=decoder.slot_tokens,
            model_limit=shape.limit or decoder.slot_tokens, dtype="int8", device="cpu",
            kernels="exact", tokenizer=tokenizer)

    # -- slots (``pool``: their ids; the KV tensors hold them all from the start)
    @property
    def nbytes(self) -> int:
        return self.decoder.nbytes

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        if parents == list(range(len(slots))):
            return
        sources = {parent: self._stash(slots[parent], length) for parent in set(parents)}
        for slot, parent in zip(slots, parents, strict=True):
            keys, values = sources[parent]
            self.decoder.keys[:, slot, :, :length] = keys
            self.decoder.values[:, slot, :, :length] = values

    def _stash(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.decoder.keys[:, slot, :, :length].clone(),
                self.decoder.values[:, slot, :, :length].clone())

    def counters(self) -> dict[str, int]:
        return {"int8_forwards": self.forwards}

    # -- model operations
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        if any(item.encoder_ids is not None or item.tree_parents for item in items):
            raise ValueError("the int8 engine runs causal chains only")
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int] | None] = []
        ends: dict[int, int] = {}  # each slot's next position in this forward
        for item in items:
            n = len(item.token_ids)
            if item.start + n > self.slot_tokens:
                raise ValueError(f"slot {item.slot} holds {self.slot_tokens} tokens; "
                                 f"{item.start + n} asked")
            if item.start < ends.get(item.slot, 0):
                # a row reads its slot's positions up to its own; written later in the same
                # forward, they would be there unchunked and not yet in chunks
                raise ValueError(f"slot {item.slot}'s rows go in position order in a forward")
            ends[item.slot] = item.start + n
            first = len(ids)
            ids += item.token_ids
            slots += [item.slot] * n
            positions += range(item.start, item.start + n)
            if item.keep_logits and n > item.keep_from:
                spans.append((len(keep), n - item.keep_from))
                keep += range(first + item.keep_from, first + n)
            else:
                spans.append(None)
        self.forwards += 1
        parts = []
        with torch.inference_mode():
            for begin in range(0, len(ids), self.chunk_rows):
                end = min(begin + self.chunk_rows, len(ids))
                kept = keep[bisect.bisect_left(keep, begin):bisect.bisect_left(keep, end)]
                parts.append(self.decoder.forward(
                    Rows(torch.tensor(ids[begin:end]), slots[begin:end], positions[begin:end]),
                    torch.tensor(kept, dtype=torch.long) - begin))
        if not parts:
            return [None] * len(items)
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        return [None if span is None else logits[span[0]:span[0] + span[1]] for span in spans]

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        raise ValueError("the int8 engine does not verify trees")


def release_freed_memory() -> None:
    """Hand memory freed by Python back to the system (glibc keeps it otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator decides
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load_int8_engine(o: TargetOptions, own: Int8Options) -> Int8Engine:
    """The target of ``o`` in int8: loaded through transformers (a folder, a short name of the
    offline pair once converted, a hub id), its linear layers quantized; slots of
    ``max_context`` tokens (0: the model's limit), as many as ``kv_budget_tokens`` holds."""
    started = time.perf_counter()
    quantized = quantized_engine()
    if o.threads:
        torch.set_num_threads(o.threads)
    model = load_causal_lm(o.model, torch.bfloat16, torch.device("cpu"))
    shape_of(model.config)  # what the engine cannot run is named before what it leaves out
    # transformers drops a checkpoint's tensors its class has no place for, with a warning
    refuse_unread(checkpoint_tensor_names(resolve_model_spec(o.model)[0]),
                  f"{o.model}'s checkpoint")
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 32768
    budget = o.kv_budget_tokens or DEFAULT_KV_BUDGET
    context = min(o.max_context or limit, limit, budget)
    num_slots = max(1, budget // context)
    decoder = Int8Decoder(model, num_slots, context, outliers=own.int8_outliers)
    tokenizer = load_tokenizer(o.model)
    engine = Int8Engine(decoder, tokenizer, eos_ids_of(model, tokenizer), o.model, num_slots,
                        o.acceptance)
    del model
    release_freed_memory()  # the checkpoint's bfloat16 weights, gone now: 3.5 GB for a 1.5B
    # the checkpoint on this machine, threads, torch and transformers (``cache_key``), fbgemm's
    # engine and activation width (VNNI or not: a virtual machine may hide it under the same
    # CPU name), the slot's length and the outliers
    key = (f"int8|{cache_key(o.model)}|{quantized}|act={activation_bits()}"
           f"|context={context}|outliers={own.int8_outliers}")
    engine.warm_up_and_time(key)
    log.info("loaded target %s in int8 (%s, %d-bit activations, %d outliers a row, %d "
             "threads): %d slots x %d tokens (%.0f MiB of weights, %.0f MiB of KV) in %.1f s",
             o.model, quantized, activation_bits(), own.int8_outliers, torch.get_num_threads(),
             num_slots, context, decoder.weight_bytes / 2**20, decoder.nbytes / 2**20,
             time.perf_counter() - started)
    return engine
