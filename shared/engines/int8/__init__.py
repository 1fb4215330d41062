"""The int8 engine: a Llama / Qwen2-family target with int8 weights on the CPU, whose verify
blocks cost much less than their tokens one by one and whose every row is computed as a
one-token step computes it (greedy speculation equals the target alone's on it).
``kernels.py`` holds the row-invariant int8 product, ``model.py`` the decoder and its KV
tensors, ``target.py`` the verifier's engine. It serves targets only: a drafter drafts on
transformers or llama.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared.engines import register
from shared.models.catalog import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.target import Engine, TargetOptions


class Int8Backend:
    name = "int8"
    drafts = False

    def claims(self, spec: str, device: str) -> bool:
        return False  # chosen by name (--engine int8), never by auto's order

    def tokenizer_spec(self, spec: str) -> str:
        return spec

    def load_target(self, options: TargetOptions) -> Engine:
        from shared.engines.int8.target import load_int8_engine

        return load_int8_engine(options)

    def load_drafter(self, spec: str, dtype: str = "auto", device: str = "auto",
                     threads: int = 0, cuda_graphs: bool = False) -> Any:
        raise ModelSpecError("the int8 engine serves targets; draft with the transformers or "
                             "llama-cpp engine")


def can_serve(spec: str) -> bool:
    """A folder (or a short name's converted folder) of an architecture this engine computes:
    ``--engine auto``'s second candidate beside llama.cpp (``shared/engines/choice.py``)."""
    import json
    from pathlib import Path

    from shared.engines.int8.model import ARCHITECTURES
    from shared.models.catalog import resolve_model_spec

    try:
        path, gguf_file = resolve_model_spec(spec)
        config = json.loads((Path(path) / "config.json").read_text())
    except (ModelSpecError, OSError, ValueError):
        return False
    return gguf_file is None and (config.get("architectures") or ["?"])[0] in ARCHITECTURES


register(Int8Backend())
