"""The int8 engine: a Llama / Qwen2-family target with int8 weights on the CPU, whose verify
blocks cost much less than their tokens one by one and whose every row is computed as a
one-token step computes it (greedy speculation equals the target alone's on it).
``kernels.py`` holds the row-invariant int8 product, ``model.py`` the decoder and its KV
tensors, ``target.py`` the verifier's engine. It serves targets only: a drafter drafts on
transformers or llama.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from shared.engines import Backend, register
from shared.models.catalog import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.target import Engine, TargetOptions


class Int8Options(BaseModel):
    int8_outliers: int = Field(
        0, ge=0, le=64, description="the int8 engine: each row's this many largest values "
        "(rounded down to a power of two) are taken out before the row's activations are "
        "quantized, so they do not set its scale (attention and MLP down projections: "
        "multiplied in float32; output head: quantized as a row of their own); measured: "
        "with 8, top-token agreement with bf16 97.1% -> 98.4% (Q4_K_M: 98.1%), and forwards "
        "cost 1.04x (one token) to 1.75x (8 sessions x 16 tokens); 0: the cheapest blocks")


class Int8Backend(Backend):
    name = "int8"
    summary = ("a Llama / Qwen2-family model transformers loads, its weights in int8 on the "
               "CPU (verify blocks much cheaper than their tokens one by one, every row exact)")
    options = Int8Options
    cpu_only = True

    # never claims a model by auto's order: chosen by name, or priced against llama.cpp

    def challenges(self, claimant: str, spec: str) -> bool:
        """Where llama.cpp claims a short name whose converted folder this engine computes."""
        return claimant == "llama-cpp" and can_serve(spec)

    def placement(self, options: Int8Options) -> list[str]:
        return ["int8_outliers"] if options.int8_outliers else []

    def load_target(self, target: TargetOptions) -> Engine:
        from shared.engines.int8.target import load_int8_engine

        return load_int8_engine(target, target.engine_options or Int8Options())


def can_serve(spec: str) -> bool:
    """A folder (or a short name's converted folder) of an architecture this engine computes:
    ``--engine auto``'s second candidate beside llama.cpp (``shared/engines/choice.py``)."""
    import json
    from pathlib import Path

    from shared.engines.int8.model import ARCHITECTURES, checkpoint_tensor_names, refuse_unread
    from shared.models.catalog import resolve_model_spec

    try:
        path, gguf_file = resolve_model_spec(spec)
        config = json.loads((Path(path) / "config.json").read_text())
        if gguf_file is None:
            refuse_unread(checkpoint_tensor_names(path), spec)
    except (ModelSpecError, OSError, ValueError):
        return False
    return gguf_file is None and (config.get("architectures") or ["?"])[0] in ARCHITECTURES \
        and not config.get("mlp_bias") and not config.get("use_qk_norm")


register(Int8Backend())
