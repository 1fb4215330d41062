"""The target model and its KV pool. Everything here runs on the model thread."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from shared.dtype_choice import load_lm_auto
from shared.engine import ForwardItem, pooled_forward
from shared.graphs import StaticForwards
from shared.kv_pool import ATTENTION_NAME, KVPool
from shared.models import (
    ModelSpecError,
    load_tokenizer,
    pick_device,
    tokenizer_fingerprint,
)
from verifier_service.seq2seq import Seq2SeqPool, seq2seq_forward
from verifier_service.settings import Settings
from verifier_service.tensor_parallel import Lockstep

log = logging.getLogger(__name__)
VERIFY_KS = (0, 1, 2, 3, 4, 6, 8)  # drafts per block timed at start (``verify_ms``)


def eos_ids_of(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def parse_device_map(text: str) -> str | dict[str, Any] | None:
    """"" -> None (one device), "auto" / "balanced" / ... as is, "{...}" -> the JSON map."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelSpecError(f"--device-map is not valid JSON: {exc}") from None
        if not isinstance(mapping, dict):
            raise ModelSpecError("--device-map JSON must map module names to devices")
        return mapping
    return text


def _hook_device(module: Any) -> torch.device | None:
    """Where accelerate's hook on this module runs it (offloaded weights are brought there)."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is None:
        return None
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def _weights_device(module: Any) -> torch.device | None:
    return next((p.device for p in module.parameters() if p.device.type != "meta"), None)


def attention_devices(model: Any, num_layers: int, default: torch.device) -> list[torch.device]:
    """The device each layer's attention runs on (the module with that ``layer_idx``): the
    nearest accelerate hook on it or a parent, else its weights' device, else ``default``."""
    modules: dict[str, Any] = dict(model.named_modules())
    devices: dict[int, torch.device] = {}
    for name, module in modules.items():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or idx in devices:  # the decoder layer or its attention
            continue
        path, found = name, None
        while found is None:
            found = _hook_device(modules[path])
            if not path:
                break
            path = path.rpartition(".")[0]
        devices[idx] = found or _weights_device(module) or default
    return [devices.get(i, default) for i in range(num_layers)]


def input_device(model: Any) -> torch.device:
    embeddings = model.get_input_embeddings()
    return (_hook_device(embeddings) or _weights_device(embeddings) or _weights_device(model)
            or torch.device("cpu"))


def host_rows(rows: torch.Tensor) -> torch.Tensor:
    """A forward's logits rows as the host path reads them: [n, vocab] float32 on the CPU."""
    return rows.float().cpu()


class TargetRunner:
    """Holds the target model and a pool of KV slots; one ``forward`` serves many sessions."""

    def __init__(self, model: Any, tokenizer: Any, name: str, max_context: int = 0,
                 kv_budget_tokens: int = 32768, tp_size: int = 1) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = input_device(model)  # where the token ids go in
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = eos_ids_of(model, tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        model_max = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 32768
        self.model_limit = model_max
        self.max_context = min(max_context, model_max) if max_context else model_max
        # One slot holds one session's whole context; the budget decides how many slots exist.
        self.max_context = min(self.max_context, kv_budget_tokens)
        num_slots = max(kv_budget_tokens // self.max_context, 1)
        self.is_encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self.lockstep: Lockstep | None = None  # tensor parallel: rank 0 leads the others
        self.verify_ms: list[tuple[int, float]] = []  # measured in warm_up (``/v1/info``)
        # "device": verify jobs are decided batched next to the logits (acceptance.py); "host":
        # each job's rows are copied to the host and decided alone (the reference path).
        self.acceptance = "device"
        # "padded": short segments attend in one call per layer; "per-session": one call each
        # (kv_pool.py). The default is the faster one measured on each kind of device.
        self.attention = "padded" if self.device.type == "cuda" else "per-session"
        self.static: StaticForwards | None = None  # --cuda-graphs (enable_static_forwards)
        self.decoder_start_token_id: int | None = None
        self.pool: KVPool | Seq2SeqPool
        if self.is_encoder_decoder:  # per-session caches (verifier_service/seq2seq.py)
            start = (getattr(model.generation_config, "decoder_start_token_id", None)
                     or model.config.decoder_start_token_id)
            self.decoder_start_token_id = int(start if start is not None else 0)
            self.pool = Seq2SeqPool(num_slots, self.max_context)
        else:
            layers = model.config.num_hidden_layers
            self.pool = KVPool(model.config, num_slots, self.max_context, self.dtype,
                               attention_devices(model, layers, self.device), tp_size)
            model.set_attn_implementation(ATTENTION_NAME)
        log.info("KV pool: %d slots x %d tokens (%.0f MiB)", num_slots, self.max_context,
                 self.pool.nbytes / 2**20)

    @classmethod
    def load(cls, spec: str, dtype: str = "auto", device: str = "auto", max_context: int = 0,
             kv_budget_tokens: int = 32768, device_map: str = "",
             offload_folder: str = "", tp_plan: str = "") -> TargetRunner:
        """``device_map``: place the model over several devices (accelerate's "auto",
        "balanced", "sequential", or a JSON {module: device} map, "disk" offloading to
        ``offload_folder``); each layer's KV slots live where that layer's attention runs."""
        started = time.perf_counter()
        torch_device = pick_device(device)
        model, chosen = load_lm_auto(spec, dtype, torch_device,
                                     device_map=parse_device_map(device_map),
                                     offload_folder=offload_folder or None,
                                     tp_plan=tp_plan or None)
        log.info("target dtype: %s", chosen)
        runner = cls(model, load_tokenizer(spec), spec, max_context, kv_budget_tokens,
                     tp_size=dist.get_world_size() if tp_plan else 1)
        runner.warm_up()  # every rank at once: the same forwards, so their collectives match
        if tp_plan:
            if not isinstance(runner.pool, KVPool):
                raise ModelSpecError("--tp-plan serves decoder-only targets only")
            runner.lockstep = runner.pool.lockstep = Lockstep()
        log.info("loaded target %s (%s, %s) in %.1f s", spec, runner.dtype, runner.device,
                 time.perf_counter() - started)
        return runner

    @classmethod
    def from_settings(cls, settings: Settings) -> TargetRunner:
        runner = cls.load(settings.model, settings.dtype, settings.device, settings.max_context,
                          settings.kv_budget_tokens, settings.device_map,
                          settings.offload_folder, settings.tp_plan)
        runner.acceptance = settings.acceptance
        if settings.cuda_graphs:
            runner.enable_static_forwards(settings.max_batch_size if settings.batching else 1)
        if settings.attention != "auto":
            runner.attention = settings.attention
        return runner

    def enable_static_forwards(self, max_batch: int, capture: bool | None = None) -> None:
        """Short batches through static-shape buckets (``graphs.py``), replayed as CUDA graphs
        when ``capture`` (default: on CUDA). One KV slot becomes the padding's scratch slot."""
        if (not isinstance(self.pool, KVPool) or self.lockstep is not None
                or len({k.device for k in self.pool.keys}) > 1):
            raise ModelSpecError("--cuda-graphs serves decoder-only targets on one device")
        self.static = StaticForwards(self.model, self.pool, self.device, max_batch, capture)
        self.static.warm()

    def warm_up(self) -> None:
        """One small forward, so the first client does not pay for kernel selection and
        allocator growth (seconds on CPU for a 1.5B model)."""
        slot = self.pool.allocate()
        if slot is None:
            return
        ids = [i % self.vocab_size for i in range(16)]
        encoder_ids = ids if self.is_encoder_decoder else None
        self.forward([ForwardItem(slot, 0, ids, False, encoder_ids)])
        self.forward([ForwardItem(slot, 16, ids[:5], True)])
        if not self.is_encoder_decoder:
            self.verify_ms = self.time_verify_blocks(slot, ids)
        self.pool.release(slot)

    def time_verify_blocks(self, slot: int, ids: list[int], ks: tuple[int, ...] = VERIFY_KS,
                           repeats: int = 2) -> list[tuple[int, float]]:
        """[k, ms] of a verify forward of k drafts on the 16-token warm-up cache (the fastest
        of ``repeats``, after one untimed): what ``/v1/info`` reports as ``verify_ms``."""
        timings = []
        for k in ks:
            if 16 + k + 1 > self.max_context:
                break
            block = [ids[i % len(ids)] for i in range(k + 1)]
            times = []
            for i in range(repeats + 1):
                started = time.perf_counter()
                rows = self.forward([ForwardItem(slot, 16, block, True)])
                if rows[0] is not None:
                    rows[0].cpu()  # the logits are ready (a GPU forward returns early)
                if i:
                    times.append(time.perf_counter() - started)
            timings.append((k, round(1e3 * min(times), 3)))
        return timings

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        """One forward pass over the new tokens of every item; [n, vocab] logits rows for the
        items that asked for them, left on the model's device in its dtype (``host_rows`` makes
        a float32 host copy). Under tensor parallelism every rank runs it."""
        if self.lockstep is not None:
            self.lockstep.announce("forward", items)
        return self.local_forward(items)

    @torch.inference_mode()
    def local_forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        if isinstance(self.pool, Seq2SeqPool):
            return seq2seq_forward(self.model, self.pool, items, self.device)
        return pooled_forward(self.model, self.pool, items, self.device,
                              padded=self.attention == "padded", static=self.static)
