"""The w4a8 engine: a GGUF target's own Q4_K / Q6_K weights on the CPU, multiplied by one
batch-invariant kernel (4-bit weights times 8-bit activations, integer sums inside a block,
float sums across blocks in one order for every row count), so every row of a verify block is
bit-equal to a one-token step and a block of k tokens costs far less than k steps.

``kernels/`` holds the kernels (one file per ISA behind one dispatch table, built once per
machine by ``build.py``), ``gguf_file.py``
maps the file, ``model.py`` is the decoder, ``target.py`` the verifier's engine. It serves
targets only (Qwen2 and Llama GGUF files whose matrices are Q4_K / Q6_K, as Q4_K_M files of
models with widths that are multiples of 256); ``--engine auto`` picks it for those on a CPU.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from shared.engines import Backend, register
from shared.models.catalog import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.target import Engine, TargetOptions


@functools.cache
def _computes(path: str, stamp: float) -> bool:
    from shared.engines.w4a8.model import GGUFFile, shape_of, weights_of

    try:
        file = GGUFFile(path)
        weights_of(file, shape_of(file))  # every tensor the decoder maps, as it maps them
    except ModelSpecError:
        return False
    return True


def computes(path: str) -> bool:
    """Whether this engine computes the GGUF file at ``path`` (its architecture and every
    matrix's type)."""
    try:
        return _computes(path, os.stat(path).st_mtime)
    except OSError:
        return False


class W4A8Options(BaseModel):
    w4a8_isa: str = Field(
        "auto", description="the w4a8 engine's kernel path: auto (the best this CPU runs: "
        "avx512-vnni, then avx-vnni, then avx2, then portable) or one by name (also "
        "avx512-vnni-256: avx-vnni's code on AVX-512, for testing it). Every path gives the same "
        "bits, so replicas on different CPUs serve the same tokens; naming one is for comparing "
        "them")


class W4A8Backend(Backend):
    name = "w4a8"
    options = W4A8Options
    summary = ("a Qwen2 / Llama GGUF file's own Q4_K / Q6_K weights on the CPU, by one "
               "batch-invariant kernel (verify blocks much cheaper than their tokens one by "
               "one, every row exact)")
    cpu_only = True

    def _computes_on(self, spec: str, device: str) -> bool:
        """A GGUF file this engine computes (or a short name whose GGUF is kept), on a CPU."""
        from shared.engines.llama_cpp.runtime import is_gguf, kept_gguf

        path = spec if is_gguf(spec) else kept_gguf(spec)
        if path is None or not computes(str(path)):
            return False
        import torch

        return device == "cpu" or (device == "auto" and not torch.cuda.is_available())

    def claims(self, spec: str, device: str) -> bool:
        """Such a file, where its kernels are built (and may be loaded) or a compiler can
        build them."""
        return self._computes_on(spec, device) and self.runs_gguf()

    def passed_over(self, spec: str, device: str) -> str:
        if not self._computes_on(spec, device):
            return ""
        from shared.engines.w4a8.build import available

        ok, why = available()
        return "" if ok else f"w4a8 would compute this file, but {why}"

    def runs_gguf(self) -> bool:
        """Where the kernels are built (and may be loaded), or a C++ compiler can build them;
        never runs the compiler to answer."""
        from shared.engines.w4a8.build import available

        return available()[0]

    def tokenizer_spec(self, spec: str) -> str:
        from shared.engines.llama_cpp.runtime import resolve_gguf

        return resolve_gguf(spec)[1]

    def load_target(self, target: TargetOptions) -> Engine:
        from shared.engines.w4a8.target import load_w4a8_engine

        return load_w4a8_engine(target)


register(W4A8Backend())
