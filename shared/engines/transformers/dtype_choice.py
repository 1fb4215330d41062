"""``--dtype auto`` and ``fastest``: what a model runs in when no dtype is asked for.

A target's ``auto`` on a CPU is float32: in bfloat16 a verify block's rows round unlike one-token
steps' enough to change greedy tokens (a tiny Llama pair here: 4 of 24 generations differed
from the target alone's), and speculation must not change greedy output. ``fastest`` (a target
that trades that for speed, and every drafter's ``auto``: a drafter only proposes) is the dtype
the model runs fastest in on this machine, measured.

On CUDA both are bfloat16. On a CPU it depends on the chip: with native bf16 (AVX512-BF16, AMX)
bfloat16 can decode much faster than float32; without it bfloat16 matmuls are emulated and
float32 wins; and what a block of k tokens costs next to one differs between the two. So the
first load of a model on a machine times forwards of the blocks the speculative loop runs (1, 3
and 5 new tokens on a short cache) in both dtypes, keeps the faster (lower sum), and records the
choice in ``$SPECDEC_HOME/dtype-choices.json`` under the model folder, the CPU, the thread count
and the torch and transformers versions, so later starts load straight into it (an entry that
is not one of the two dtypes is ignored with a warning and measured again).

The two candidates are the same weights: a bf16 / fp16 checkpoint is loaded in bfloat16 and
widened to float32 (exact), a float32 checkpoint is loaded in float32 and narrowed; when float32
wins after narrowing, it is loaded again from disk rather than widened back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.engines.transformers.timing import plain_step_ms
from shared.machine_cache import cpu_name, read_json, specdec_home, update_json
from shared.models.catalog import load_lm, pick_dtype, resolve_model_spec

log = logging.getLogger("specdec.dtype")

BLOCKS = (1, 3, 5)  # new tokens per timed forward: a plain step, k = 2 and k = 4 verify blocks
CONTEXT = 32  # tokens already in the cache


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    block_ms: dict[str, dict[int, float]]  # dtype name -> new tokens -> ms (empty: cached)
    cached: bool

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if self.cached:
            return f"{name} (measured before on this machine; {cache_path()})"
        timings = "; ".join(f"{dt}: " + " / ".join(f"{ms:.0f}" for ms in row.values())
                            for dt, row in self.block_ms.items())
        return f"{name} (ms for {' / '.join(map(str, BLOCKS))} new tokens: {timings})"


def cache_path() -> Path:
    """``$SPECDEC_DTYPE_CACHE``, else ``$SPECDEC_HOME/dtype-choices.json``."""
    return Path(os.environ.get("SPECDEC_DTYPE_CACHE") or specdec_home() / "dtype-choices.json")


def cache_key(spec: str) -> str:
    import transformers

    path, gguf_file = resolve_model_spec(spec)
    folder = Path(path).resolve()
    config = folder / (gguf_file or "config.json")
    stamp = int(config.stat().st_mtime) if config.exists() else 0
    return (f"{folder / (gguf_file or '')}|{stamp}|{cpu_name()}|threads={torch.get_num_threads()}"
            f"|torch={torch.__version__}|transformers={transformers.__version__}")


CHOICES = ("float32", "bfloat16")


def _cached_choice(key: str) -> str | None:
    """The dtype recorded under ``key``: None where there is none, or where what is there is
    not one of :data:`CHOICES` (ignored with a warning: measured again)."""
    known = read_json(cache_path(), "the dtype choices").get(key)
    if known is not None and known not in CHOICES:
        log.warning("ignoring the dtype choice recorded in %s for this model (%.80r is not one "
                    "of %s): measuring again", cache_path(), known, ", ".join(CHOICES))
        return None
    return known  # type: ignore[no-any-return]


def _write_cache(key: str, dtype: torch.dtype) -> None:
    def keep(data: dict[str, Any]) -> None:
        data[key] = str(dtype).removeprefix("torch.")

    update_json(cache_path(), keep, "the dtype choice")


def block_ms(model: Any, repeats: int = 3) -> dict[int, float]:
    """Median ms of a forward of each of ``BLOCKS`` new tokens on a ``CONTEXT``-token cache."""
    context = [i % int(model.config.vocab_size) for i in range(CONTEXT)]
    return {new: plain_step_ms(model, context, new, repeats) for new in BLOCKS}


def checkpoint_is_narrow(spec: str) -> bool:
    """The checkpoint's weights are bf16 / fp16 (so bfloat16 loses nothing of them... fp16's
    range aside, which bf16 covers)."""
    from transformers import AutoConfig

    path, gguf_file = resolve_model_spec(spec)
    if gguf_file:
        return False
    dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    return str(dtype).removeprefix("torch.") in ("bfloat16", "float16")


def cast_parameters(model: Any, dtype: torch.dtype) -> None:
    """Every parameter in ``dtype``; buffers stay as loaded (transformers keeps e.g. RoPE's
    inverse frequencies in float32 whatever the dtype; ``model.to`` would narrow them too, and
    the model would then differ from one loaded in ``dtype``)."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.config.dtype = dtype


def load_fastest(spec: str, load: Callable[[torch.dtype], Any],
                 measure: Callable[[Any], dict[int, float]] = block_ms) -> tuple[Any, DtypeChoice]:
    """The model loaded by ``load(dtype)`` in the faster of float32 and bfloat16 on this CPU
    (``measure``: ms per block size, the same sizes for both)."""
    key = cache_key(spec)
    known = _cached_choice(key)
    if known is not None:
        dtype = getattr(torch, known)
        return load(dtype), DtypeChoice(dtype, {}, cached=True)
    narrow = checkpoint_is_narrow(spec)
    first = torch.bfloat16 if narrow else torch.float32
    second = torch.float32 if narrow else torch.bfloat16
    model = load(first)
    timings = {str(first): measure(model)}
    cast_parameters(model, second)
    timings[str(second)] = measure(model)
    total = {dt: sum(row.values()) for dt, row in timings.items()}
    dtype = first if total[str(first)] <= total[str(second)] else second
    if dtype == first:
        if narrow:
            cast_parameters(model, first)  # back from the exact widening
        else:
            del model
            model = load(first)  # float32 again from disk, not widened from bf16
    _write_cache(key, dtype)
    block = {dt.removeprefix("torch."): row for dt, row in timings.items()}
    return model, DtypeChoice(dtype, block, cached=False)


def load_lm_auto(spec: str, dtype: str, device: torch.device, exact: bool = True,
                 **placement: Any) -> tuple[Any, str]:
    """``load_lm`` with ``--dtype``: ``auto`` on a CPU is float32 where ``exact`` (a target),
    else it is ``fastest``, which on a CPU measures (``load_fastest``) for a causal LM on one
    device. Returns the model and a line saying what was chosen and why."""
    from transformers import AutoConfig

    if dtype == "auto" and device.type == "cpu" and exact:
        return (load_lm(spec, torch.float32, device, **placement),
                "float32 (auto on cpu: bfloat16 blocks round unlike one-token steps; "
                "--dtype fastest measures the faster)")
    placed = any(placement.get(name) for name in ("device_map", "tp_plan"))
    if dtype not in ("auto", "fastest") or device.type != "cpu" or placed:
        chosen = pick_dtype(dtype, device)
        model = load_lm(spec, chosen, device, **placement)
        why = "asked for" if dtype not in ("auto", "fastest") else f"{dtype} on {device.type}"
        return model, f"{str(chosen).removeprefix('torch.')} ({why})"
    path, gguf_file = resolve_model_spec(spec)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file or getattr(AutoConfig.from_pretrained(path, **kwargs), "is_encoder_decoder",
                            False):
        # not measured: GGUF weights are dequantized on load, encoder-decoders decode otherwise
        model = load_lm(spec, torch.bfloat16, device, **placement)
        return model, "bfloat16 (auto, not measured for GGUF files and encoder-decoders)"
    model, choice = load_fastest(
        spec, lambda chosen: load_lm(spec, chosen, device, encoder_decoder=False, **placement))
    return model, choice.describe()
