"""The transformers engine: any model transformers loads, on any device. The verifier's targets
(``target.py``: KV slots in one pool, ``kv_pool.py`` / ``kv_regions.py``, static-shape forwards
``graphs.py``; ``seq2seq.py`` for encoder-decoders; ``tensor_parallel.py``), the client's model
drafters (``drafter.py``, ``pooled_drafter.py`` for ``--cuda-graphs``) and the measured dtype
choice both sides make (``dtype_choice.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from shared.engines import Backend, register
from shared.models.catalog import ModelSpecError

if TYPE_CHECKING:
    from shared.engines.drafter import LMDrafter
    from shared.engines.target import Engine, TargetOptions


@dataclass
class TransformersDrafterModel:
    """A loaded drafter model, shared (not copied) by every drafter made from it."""

    spec: str
    model: Any
    dtype: str  # the dtype chosen, and why
    encoder_decoder: bool
    cuda_graphs: bool = False  # drafters keep their KV in a slot, one-token steps as graphs

    def new_drafter(self, vocab_size: int, context_tokens: int, min_prob: float = 0.0,
                    tree_width: int = 1) -> LMDrafter:
        from shared.engines.transformers.drafter import HFDrafter, HFSeq2SeqDrafter

        if self.cuda_graphs:
            from shared.engines.transformers.pooled_drafter import PooledDrafter

            return PooledDrafter(self.model, vocab_size, context_tokens, name=self.spec,
                                 min_prob=min_prob, tree_width=tree_width)
        kind = HFSeq2SeqDrafter if self.encoder_decoder else HFDrafter
        return kind(self.model, vocab_size, name=self.spec, min_prob=min_prob,
                    tree_width=tree_width)


class TransformersOptions(BaseModel):
    dtype: Literal["auto", "fastest", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the transformers engine's dtype. auto: float32 on a CPU (in "
        "bfloat16 a verify block rounds unlike one-token steps and greedy output may differ "
        "from the target alone's), bfloat16 on CUDA. fastest: on a CPU the faster of float32 "
        "and bfloat16 for this model, measured at its first load here and cached in "
        "$SPECDEC_DTYPE_CACHE (default $SPECDEC_HOME/dtype-choices.json); bfloat16 on CUDA, "
        "for GGUF files and encoder-decoders")
    device_map: str = Field("", description="a target larger than one device: accelerate's "
                            "placement (auto, balanced, sequential: over the GPUs, then CPU "
                            "offload) or a JSON {module: device} map; empty: all on --device")
    offload_folder: str = Field("", description="with --device-map: where modules placed on "
                                "\"disk\" are kept")
    tp_plan: str = Field("", description="tensor parallel: \"auto\" shards the target over "
                         "the ranks of a torchrun group (rank 0 serves); empty: off")
    attention: Literal["auto", "padded", "per-session"] = Field(
        "auto", description="padded: a batch's short blocks attend in one call per layer; "
        "per-session: one call per session; auto: padded on CUDA, per-session on CPU")
    cuda_graphs: bool = Field(False, description="short batches (blocks of up to "
                              "--max-draft-tokens drafts) "
                              "run in static-shape buckets replayed as CUDA graphs (on CPU: the "
                              "same layout, eagerly); one KV slot is kept for padding")
    kv_memory_fraction: float = Field(0.9, gt=0, le=1, description="with kv_budget_tokens 0 "
                                      "on CUDA: the share of the device's memory the model, "
                                      "its activations and the KV pool may use together")

    @model_validator(mode="after")
    def _one_placement(self) -> TransformersOptions:
        if self.tp_plan and self.device_map:
            raise ValueError("tp_plan and device_map are two ways to place one model: choose "
                             "one")
        return self


class TransformersBackend(Backend):
    name = "transformers"
    summary = "transformers, any model it loads, on any device"
    options = TransformersOptions

    def claims(self, spec: str, device: str) -> bool:
        return True  # folders, hub ids, a short name without its GGUF, CUDA

    def claims_drafter(self, spec: str, device: str, cuda_graphs: bool) -> bool:
        return True

    def placement(self, options: TransformersOptions) -> list[str]:
        """Only this engine places a model over devices or replays CUDA graphs."""
        return [name for name in ("device_map", "tp_plan", "cuda_graphs")
                if getattr(options, name)]

    def preflight(self, options: TransformersOptions) -> None:
        from shared.engines.transformers.tensor_parallel import under_torchrun

        if options.tp_plan and not under_torchrun():
            raise ModelSpecError("--tp-plan shards the model over a torchrun group: start it "
                                 "with `torchrun --nproc-per-node N -m verifier_service.cli "
                                 "...`")

    def serve(self, engine: Engine, serve: Callable[[], None],
              call: Callable[..., Any]) -> None:
        """Tensor parallel: rank 0 serves; the other ranks run its model operations on their
        shards until it stops."""
        from shared.engines.transformers.tensor_parallel import TensorParallel, follow

        if not isinstance(engine, TensorParallel):
            serve()
        elif not engine.leader:
            call(follow, engine)
        else:
            try:
                serve()
            finally:
                engine.stop()

    def load_target(self, target: TargetOptions) -> Engine:
        from shared.engines.transformers.target import load

        return load(target, target.engine_options or TransformersOptions())

    def load_drafter(self, spec: str, dtype: str = "auto", device: str = "auto",
                     threads: int = 0, cuda_graphs: bool = False) -> TransformersDrafterModel:
        # threads: torch's intra-op threads are the process's (SpecDecClient sets them)
        from shared.engines.transformers.dtype_choice import load_lm_auto
        from shared.models.catalog import pick_device

        # a drafter only proposes: its auto is the fastest dtype, not the exact one
        model, chosen = load_lm_auto(spec, dtype, pick_device(device), exact=False)
        encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        if encoder_decoder and cuda_graphs:
            raise ModelSpecError("cuda_graphs drafts with decoder-only models only")
        return TransformersDrafterModel(spec, model, chosen, encoder_decoder, cuda_graphs)


register(TransformersBackend())
