"""The transformers engine: any model transformers loads, on any device. The verifier's targets
(``target.py``: KV slots in one pool, ``kv_pool.py`` / ``kv_regions.py``, static-shape forwards
``graphs.py``; ``seq2seq.py`` for encoder-decoders; ``tensor_parallel.py``), the client's model
drafters (``drafter.py``, ``pooled_drafter.py`` for ``--cuda-graphs``) and the measured dtype
choice both sides make (``dtype_choice.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.engines import register
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


class TransformersBackend:
    name = "transformers"
    drafts = True

    def claims(self, spec: str, device: str) -> bool:
        return True  # folders, hub ids, a short name without its GGUF, CUDA

    def tokenizer_spec(self, spec: str) -> str:
        return spec

    def load_target(self, options: TargetOptions) -> Engine:
        from shared.engines.transformers.target import load

        return load(options)

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
