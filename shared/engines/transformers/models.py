"""Facts about a transformers target: what it is (:class:`ModelInfo`) and where its parts run."""

from __future__ import annotations

import json
from typing import Any

import torch

from shared.engines import DEFAULT_KV_BUDGET
from shared.engines.target import ModelInfo
from shared.engines.transformers.kv_pool import head_layout
from shared.models.catalog import ModelSpecError, tokenizer_fingerprint


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




def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Keys and values of one token over every layer."""
    _, kv_heads, head_dim = head_layout(config)
    size = torch.empty(0, dtype=dtype).element_size()
    return int(2 * config.num_hidden_layers * kv_heads * head_dim * size)


def activation_bytes(config: Any, batch_tokens: int) -> int:
    """Room a forward of ``batch_tokens`` tokens needs besides the weights and the KV pool: its
    float32 logits twice (the rows and their softmax) and the widest MLP activations, plus
    256 MiB for the allocator and kernels' workspaces. An estimate on the safe side."""
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    wide = int(getattr(config, "intermediate_size", 0) or 4 * config.hidden_size)
    return batch_tokens * 4 * (2 * vocab + 3 * wide) + 256 * 2**20


def kv_budget(config: Any, dtype: torch.dtype, device: torch.device, requested: int,
              fraction: float, batch_tokens: int) -> int:
    """The KV pool's size in tokens: ``requested`` when set; on CUDA (``requested`` 0) what is
    left of ``fraction`` of the device's memory after what is in use now (the model) and a
    forward's activations; elsewhere ``DEFAULT_KV_BUDGET``."""
    if requested:
        return requested
    if device.type != "cuda":
        return DEFAULT_KV_BUDGET
    free, total = torch.cuda.mem_get_info(device)
    room = fraction * total - (total - free) - activation_bytes(config, batch_tokens)
    tokens = int(room // kv_bytes_per_token(config, dtype))
    if tokens < 1024:
        raise ModelSpecError(
            f"{device} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB: no room for "
            f"a KV pool within kv_memory_fraction {fraction}; raise it or set kv_budget_tokens")
    return tokens


def describe_model(model: Any, tokenizer: Any, name: str, max_context: int,
                   kv_budget_tokens: int, device: torch.device) -> tuple[ModelInfo, int]:
    """The target's :class:`ModelInfo` and how many sessions of ``max_context`` tokens the KV
    budget holds at their longest (the encoder-decoder engine's slots)."""
    model_limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 32768
    context = min(max_context, model_limit) if max_context else model_limit
    context = min(context, kv_budget_tokens)
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    start = None
    if encoder_decoder:
        start = (getattr(model.generation_config, "decoder_start_token_id", None)
                 or model.config.decoder_start_token_id)
        start = int(start if start is not None else 0)
    info = ModelInfo(
        name=name, vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        eos_token_ids=eos_ids_of(model, tokenizer),
        fingerprint=tokenizer_fingerprint(tokenizer), max_context=context,
        model_limit=model_limit,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."), device=str(device),
        encoder_decoder=encoder_decoder, decoder_start_token_id=start, tokenizer=tokenizer)
    return info, max(kv_budget_tokens // context, 1)
