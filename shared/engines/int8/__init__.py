"""The int8 engine: a Llama / Qwen2-family target with int8 weights on the CPU, whose verify
blocks cost much less than their tokens one by one and whose every row is computed as a
one-token step computes it (greedy speculation equals the target alone's on it).
``kernels.py`` holds the row-invariant int8 product, ``model.py`` the decoder and its KV
tensors, ``target.py`` the verifier's engine. It serves targets only: a drafter drafts on
transformers or llama.cpp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared.engines import register
from shared.models import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.target import Engine, TargetOptions


class Int8Backend:
    name = "int8"

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


register(Int8Backend())
