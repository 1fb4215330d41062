"""The llama.cpp engine (llama-cpp-python, the ``[llama]`` extra): GGUF targets and drafters on
a CPU. ``runtime.py`` wraps the library (one context, many sequences, the AMX and repacked-kernel
probes), ``target.py`` serves the verifier's sessions, ``drafter.py`` drafts on the client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from shared.engines import Backend, register
from shared.models.catalog import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.drafter import LMDrafter
    from shared.engines.target import Engine, TargetOptions


@dataclass
class GGUFDrafterModel:
    """A GGUF drafter's weights, shared by the contexts of every drafter made from them."""

    spec: str
    weights: Any  # runtime.GGUFWeights
    threads: int
    dtype: str = "gguf (llama.cpp)"
    encoder_decoder: bool = False

    def new_drafter(self, vocab_size: int, context_tokens: int, min_prob: float = 0.0,
                    tree_width: int = 1) -> LMDrafter:
        from shared.engines.llama_cpp.drafter import LlamaCppDrafter

        return LlamaCppDrafter(self.weights, vocab_size, context_tokens, self.threads,
                               name=self.spec, min_prob=min_prob, tree_width=tree_width)


class LlamaCppOptions(BaseModel):
    kernels: Literal["exact", "fast"] = Field(
        "exact", description="the llama-cpp engine's kernels. exact: every row of a verify "
        "block computed as a one-token step computes it (at most 3 rows per llama_decode, "
        "one-row kernels; prompts alone in whole batches cut at fixed positions; one KV stream "
        "per session), so greedy output equals the target alone's token for token at any k and "
        "load. fast: llama.cpp's whole batches (multi-row kernels, a KV stream per session, as "
        "llama-server -np N lays them out): cheaper blocks and batches of 4 rows and more, but "
        "greedy output may differ from the target alone's, from run to run and with load")


class LlamaCppBackend(Backend):
    name = "llama-cpp"
    summary = ("llama.cpp, for a .gguf file or a short name whose GGUF is kept (CPU; needs the "
               "[llama] extra)")
    options = LlamaCppOptions
    cpu_only = True

    def claims(self, spec: str, device: str) -> bool:
        """A .gguf file, or a short name of the offline pair whose GGUF file is kept
        (``shared/models/fetch.py`` keeps it where llama.cpp is installed), on a CPU where
        llama-cpp-python is installed: llama.cpp decoded the same file 4.5-6.5x faster than
        transformers on the 2-core CPUs of docs/benchmarks.md."""
        from shared.engines.llama_cpp.runtime import is_gguf, kept_gguf, llama_available

        if not (is_gguf(spec) or kept_gguf(spec)) or not llama_available():
            return False
        import torch

        return device == "cpu" or (device == "auto" and not torch.cuda.is_available())

    def runs_gguf(self) -> bool:
        from shared.engines.llama_cpp.runtime import llama_available

        return llama_available()

    def tokenizer_spec(self, spec: str) -> str:
        from shared.engines.llama_cpp.runtime import resolve_gguf

        return resolve_gguf(spec)[1]

    def placement(self, options: LlamaCppOptions) -> list[str]:
        return ["kernels"] if options.kernels != "exact" else []

    def load_target(self, target: TargetOptions) -> Engine:
        from shared.engines import DEFAULT_KV_BUDGET
        from shared.engines.llama_cpp.target import load_llama_engine

        own = target.engine_options or LlamaCppOptions()
        return load_llama_engine(target.model, target.max_context,
                                 target.kv_budget_tokens or DEFAULT_KV_BUDGET, target.threads,
                                 target.max_batch_tokens, target.acceptance, own.kernels)

    def load_drafter(self, spec: str, dtype: str = "auto", device: str = "auto",
                     threads: int = 0, cuda_graphs: bool = False) -> GGUFDrafterModel:
        from shared.engines.llama_cpp.runtime import GGUFWeights, resolve_gguf

        if cuda_graphs:
            raise ModelSpecError("cuda_graphs is for a transformers drafter on CUDA; the "
                                 "llama-cpp drafter runs on the CPU")
        path, _ = resolve_gguf(spec)
        return GGUFDrafterModel(spec, GGUFWeights(path, threads), threads)


register(LlamaCppBackend())
