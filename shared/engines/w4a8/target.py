"""The w4a8 engine's target: :class:`~shared.engines.w4a8.model.W4A8Decoder` behind the
verifier's engine interface, a session per KV slot (the int8 engine's slots and batching, over
this decoder)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from shared.engines import DEFAULT_KV_BUDGET
from shared.engines.int8.target import Int8Engine
from shared.engines.target import TargetOptions, device_name
from shared.engines.w4a8.build import choose_isa, isa_name
from shared.engines.w4a8.model import GGUFFile, W4A8Decoder
from shared.machine_cache import file_stamp
from shared.models.catalog import load_tokenizer

log = logging.getLogger(__name__)


class W4A8Engine(Int8Engine):
    """A GGUF target's own Q4_K / Q6_K weights on the CPU, every row computed as a one-token
    step computes it."""

    def __init__(self, decoder: W4A8Decoder, tokenizer: Any, eos_token_ids: list[int],
                 name: str, num_slots: int, acceptance: str = "device") -> None:
        super().__init__(decoder, tokenizer, eos_token_ids, name, num_slots,  # type: ignore[arg-type]
                         acceptance)
        self.info = replace(self.info, dtype=f"gguf w4a8 ({isa_name()})")

    def counters(self) -> dict[str, int]:
        return {"w4a8_forwards": self.forwards}


def eos_ids(file: GGUFFile, tokenizer: Any, vocab: int) -> list[int]:
    """The tokenizer's EOS and the file's own EOS / EOT ids (as the llama.cpp engine's)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = file.field(key)
        if isinstance(value, int) and 0 <= value < vocab:
            ids.add(value)
    return sorted(ids)


def load_w4a8_engine(o: TargetOptions) -> W4A8Engine:
    """The GGUF target of ``o`` (a .gguf file, or a short name whose GGUF is kept): slots of
    ``max_context`` tokens (0: the file's context length), as many as ``kv_budget_tokens``
    holds."""
    from shared.engines.llama_cpp.runtime import resolve_gguf

    started = time.perf_counter()
    if o.threads:
        torch.set_num_threads(o.threads)
    path, tokenizer_spec = resolve_gguf(o.model)
    options = o.engine_options
    choose_isa(getattr(options, "w4a8_isa", None))
    file = GGUFFile(path)
    budget = o.kv_budget_tokens or DEFAULT_KV_BUDGET
    limit = int(file.field(f"{file.architecture()}.context_length", 0) or 32768)
    context = min(o.max_context or limit, limit, budget)
    num_slots = max(1, budget // context)
    decoder = W4A8Decoder(file, num_slots, context)
    tokenizer = load_tokenizer(tokenizer_spec)
    engine = W4A8Engine(decoder, tokenizer, eos_ids(file, tokenizer, decoder.shape.vocab),
                        o.model, num_slots, o.acceptance)
    engine.warm_up_and_time(f"w4a8|{file_stamp(path)}|{device_name('cpu')}"
                            f"|isa={isa_name()}|threads={torch.get_num_threads()}"
                            f"|context={context}")
    log.info("loaded target %s on the w4a8 engine (%s, %d threads): %d slots x %d tokens "
             "(%.0f MiB of weights mapped, %.0f MiB packed, %.0f MiB of KV) in %.1f s", path,
             engine.info.dtype, torch.get_num_threads(), num_slots, context,
             decoder.weight_bytes / 2**20, decoder.packed_bytes / 2**20, decoder.nbytes / 2**20,
             time.perf_counter() - started)
    return engine
