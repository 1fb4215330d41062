"""Wall-clock timing of model work, shared by ``--dtype auto`` (``dtype_choice.py``) and the
benchmarks: a median over repeats that waits for queued GPU work, and one transformers decode
step of n tokens on a KV cache."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shared.engines.transformers.kv_cache import with_cache


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], repeats: int, device: torch.device | None = None,
              warm: int = 1) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` calls after ``warm`` unmeasured ones;
    on CUDA each call is timed to the end of its queued work."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        if device is not None:
            sync(device)
        started = time.perf_counter()
        fn()
        if device is not None:
            sync(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def plain_step_ms(model: Any, context: list[int], new: int, repeats: int, warm: int = 1) -> float:
    """A transformers decode step of ``new`` tokens on top of a ``context``-token DynamicCache
    (on the model's device)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([context], device=device), **with_cache(model, cache))

    def step() -> None:
        model(input_ids=torch.tensor([context[:new]], device=device),
              **with_cache(model, cache), logits_to_keep=new)
        cache.crop(-new)  # drop the step again

    return median_ms(step, repeats, device, warm)
