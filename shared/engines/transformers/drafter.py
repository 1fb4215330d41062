"""Model drafters on transformers: a causal LM with its own ``DynamicCache``, and an
encoder-decoder drafter for an encoder-decoder target."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from shared.engines.drafter import LMDrafter, align_vocab
from shared.engines.transformers.kv_cache import crop_cache, with_cache
from shared.protocol.sampling import SamplingConfig


class HFDrafter(LMDrafter):
    """A Hugging Face causal LM drafting with its own ``DynamicCache``."""

    def __init__(self, model: Any, vocab_size: int, name: str = "hf",
                 min_prob: float = 0.0, tree_width: int = 1,
                 alternative_min_prob: float = 0.05) -> None:
        super().__init__(vocab_size, name, min_prob, tree_width, alternative_min_prob)
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | EncoderDecoderCache | None = None  # made at first use

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        if not ids:  # nothing new: the last position's logits are those of the last forward
            return self.last_logits
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        inputs = torch.tensor([ids], device=self.device)  # [1, n]
        out = self.model(input_ids=inputs, **with_cache(self.model, self.cache),
                         logits_to_keep=1)
        self.cached.extend(ids)
        self.last_logits = align_vocab(out.logits[0, -1].float().cpu(), self.vocab_size)
        return self.last_logits  # [vocab]

    def _roll_back(self, keep: int) -> None:
        if self.cache is not None:
            crop_cache(self.cache, keep)


class HFSeq2SeqDrafter(HFDrafter):
    """An encoder-decoder drafter (T5, BART, ...) for an encoder-decoder target with the same
    tokenizer: it encodes the source once per sequence and drafts decoder tokens with its own
    decoder cache (self-attention cropped like :class:`HFDrafter`'s, cross-attention kept). A
    new sequence with the same source keeps the encoding, the cross-attention and the decoder
    cache's common prefix."""

    source: list[int] | None = None  # the encoder ids of ``encoded``

    def warm_up(self) -> None:
        ids = [i % self.model.config.vocab_size for i in range(16)]
        self.reset(ids[:1], ids)
        self.propose(2, SamplingConfig(), torch.Generator())

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        if encoder_ids is None:
            raise ValueError("an encoder-decoder drafter needs the source (encoder_ids)")
        if encoder_ids == self.source and self.cache is not None:
            self.committed = []
            self.commit(list(prompt_ids))  # crops the decoder's self-attention cache
            return
        self.committed = list(prompt_ids)
        self.cached = []
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.source = list(encoder_ids)
        with torch.inference_mode():
            self.encoded = self.model.get_encoder()(
                input_ids=torch.tensor([encoder_ids], device=self.device))

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        if not ids:
            return self.last_logits
        out = self.model(encoder_outputs=self.encoded,
                         decoder_input_ids=torch.tensor([ids], device=self.device),
                         **with_cache(self.model, self.cache))
        self.cached.extend(ids)
        self.last_logits = align_vocab(out.logits[0, -1].float().cpu(), self.vocab_size)
        return self.last_logits  # [vocab]
