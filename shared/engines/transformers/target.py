"""The causal target's engine: the model and its KV slot pool, and how a target is loaded.
Everything here runs on the model thread."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from shared.engines import DEFAULT_KV_BUDGET
from shared.engines.target import (
    BatchForward,
    Engine,
    ForwardItem,
    PoolSlots,
    TargetOptions,
    check_context,
    device_name,
)
from shared.engines.transformers import TransformersOptions
from shared.engines.transformers.dtype_choice import cache_key, load_lm_auto
from shared.engines.transformers.graphs import StaticForwards
from shared.engines.transformers.kv_pool import KVPool, attention_kernels, use_ragged_attention
from shared.engines.transformers.models import (
    attention_devices,
    describe_model,
    input_device,
    kv_budget,
    parse_device_map,
)
from shared.engines.transformers.pooled import pooled_forward
from shared.engines.transformers.seq2seq import Seq2SeqEngine
from shared.engines.transformers.tensor_parallel import TensorParallel
from shared.models.catalog import ModelSpecError, load_tokenizer, pick_device

log = logging.getLogger(__name__)


class CausalEngine(PoolSlots, BatchForward):
    """A decoder-only target and a pool of KV slots; one ``forward`` serves many sessions."""

    trees = True

    def __init__(self, model: Any, tokenizer: Any, name: str, max_context: int = 0,
                 kv_budget_tokens: int = DEFAULT_KV_BUDGET, tp_size: int = 1,
                 acceptance: str = "device") -> None:
        self.model = model
        self.acceptance = acceptance
        self.tokenizer = tokenizer
        self.device = input_device(model)  # where the token ids go in
        self.dtype = next(model.parameters()).dtype
        self.info, num_slots = describe_model(model, tokenizer, name, max_context,
                                              kv_budget_tokens, self.device)
        # "padded": short segments attend in one call per layer; "per-session": one call each
        # (kv_pool.py). The default is the faster one measured on each kind of device.
        self.attention = "padded" if self.device.type == "cuda" else "per-session"
        self.static: StaticForwards | None = None  # --cuda-graphs (enable_static_forwards)
        layers = model.config.num_hidden_layers
        self.pool = KVPool(model.config, num_slots, self.info.max_context, self.dtype,
                           attention_devices(model, layers, self.device), tp_size,
                           total_tokens=max(kv_budget_tokens, self.info.max_context))
        use_ragged_attention(model)
        log.info("KV pool: %d tokens (%.0f MiB): %d sessions of %d tokens, up to %d at %d",
                 self.pool.regions.total, self.pool.nbytes / 2**20, self.pool.num_slots,
                 self.pool.regions.smallest, num_slots, self.info.max_context)

    # -- model operations
    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        return pooled_forward(self.model, self.pool, items, self.device,
                              padded=self.attention == "padded", static=self.static)

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        self.pool.compact(slot, [root + 1 + node for node in path],
                          list(range(root + 1, root + 1 + len(path))))

    def counters(self) -> dict[str, int]:
        static = self.static
        return {"kv_region_moves": self.pool.moves,
                "static_forwards": static.replays if static else 0,
                "static_fallbacks": static.fallbacks if static else 0}

    # -- start-up
    def enable_static_forwards(self, max_batch: int, capture: bool | None = None,
                               max_length: int = 17) -> None:
        """Short batches (up to ``max_length`` tokens a segment) through static-shape buckets
        (``graphs.py``), all built - on CUDA captured as graphs, when ``capture`` - before the
        verifier says ready. One KV slot becomes the padding's scratch slot."""
        if len({k.device for k in self.pool.keys}) > 1:
            raise ModelSpecError("--cuda-graphs serves a target on one device")
        self.static = StaticForwards(self.model, self.pool, self.device, max_batch, capture,
                                     max_length)
        self.static.warm()

    def warm_up(self) -> None:
        """One small forward, so the first client does not pay for kernel selection and
        allocator growth (seconds on CPU for a 1.5B model); then the verify costs. A session
        context below ``MIN_CONTEXT`` is refused first (ModelSpecError)."""
        check_context(self.info.max_context)
        slot = self.pool.allocate()
        if slot is None:
            return
        ids = [i % self.info.vocab_size for i in range(16)]
        self.forward([ForwardItem(slot, 0, ids, False)])
        self.forward([ForwardItem(slot, 16, ids[:5], True)])
        # the model file on this machine, threads, torch and transformers (as --dtype auto's
        # record), and what else the forwards depend on: the attention path, static shapes and
        # the slot's length
        key = (f"transformers|{cache_key(self.info.name)}|{self.info.dtype}"
               f"|{device_name(self.device)}|attention={self.attention}"
               f"|graphs={self.static is not None}|context={self.info.max_context}")
        # Tensor parallel: every rank times (the same forwards, so their collectives match)
        # rather than each deciding from a file that may differ between hosts.
        costs = (self.time_verify_blocks(slot, ids) if dist.is_available() and
                 dist.is_initialized() else self.measured_verify_ms(slot, ids, key))
        self.info = replace(self.info, verify_ms=costs)
        self.pool.release(slot)
        log.info("attention kernels (%s): %s", self.attention,
                 attention_kernels(self.model.config, self.dtype, self.device))


def load(o: TargetOptions, own: TransformersOptions) -> Engine:
    """A transformers target. ``device_map``: place the model over several devices
    (accelerate's "auto", "balanced", "sequential", or a JSON {module: device} map, "disk"
    offloading to ``offload_folder``); each layer's KV slots live where that layer's attention
    runs. ``static_batch``: serve batches of up to that many jobs through static-shape buckets
    (``--cuda-graphs``). ``kv_budget_tokens`` 0: sized from the device's free memory on CUDA
    (``kv_memory_fraction``; ``models.kv_budget``)."""
    spec, device_map, tp_plan = o.model, own.device_map, own.tp_plan
    static_batch = o.max_batch_size if own.cuda_graphs else 0
    kv_budget_tokens = o.kv_budget_tokens
    started = time.perf_counter()
    model, chosen = load_lm_auto(spec, own.dtype, pick_device(o.device),
                                 device_map=parse_device_map(device_map),
                                 offload_folder=own.offload_folder or None, tp_plan=tp_plan or None)
    log.info("target dtype: %s", chosen)
    if device_map or tp_plan:  # the pool spreads over devices: no one device's free memory
        kv_budget_tokens = kv_budget_tokens or DEFAULT_KV_BUDGET
    kv_budget_tokens = kv_budget(model.config, next(model.parameters()).dtype,
                                 input_device(model), kv_budget_tokens, own.kv_memory_fraction,
                                 o.max_batch_tokens)
    tokenizer = load_tokenizer(spec)
    engine: CausalEngine | Seq2SeqEngine
    if getattr(model.config, "is_encoder_decoder", False):
        if tp_plan or static_batch:
            raise ModelSpecError("--tp-plan and --cuda-graphs serve decoder-only targets only")
        engine = Seq2SeqEngine(model, tokenizer, spec, o.max_context, kv_budget_tokens,
                               acceptance=o.acceptance)
    else:
        engine = CausalEngine(model, tokenizer, spec, o.max_context, kv_budget_tokens,
                              tp_size=dist.get_world_size() if tp_plan else 1,
                              acceptance=o.acceptance)
        if own.attention != "auto":
            engine.attention = own.attention
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    engine.info = replace(engine.info, kernels=f"inexact: torch's {dtype} matrix kernels round "
                          "by row count" + ("" if dtype == "float32" else
                                            " (greedy output may differ from the target alone's)"))
    engine.warm_up()  # every rank at once: the same forwards, so their collectives match
    if static_batch and isinstance(engine, CausalEngine):
        if tp_plan:
            raise ModelSpecError("--cuda-graphs serves a target on one device")
        engine.enable_static_forwards(static_batch, max_length=o.max_draft_tokens + 1)
    log.info("loaded target %s (%s, %s) in %.1f s", spec, engine.info.dtype, engine.info.device,
             time.perf_counter() - started)
    return TensorParallel(engine) if tp_plan else engine
