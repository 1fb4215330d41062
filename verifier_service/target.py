"""The target model and what the verifier does with it. Everything here runs on the model thread."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from shared.kv_cache import crop_cache
from shared.models import (
    load_causal_lm,
    load_tokenizer,
    pick_device,
    pick_dtype,
    tokenizer_fingerprint,
)
from shared.sampling import (
    SamplingConfig,
    draw_uniforms,
    greedy_tokens,
    process_logits,
    sample_from_probs,
)

log = logging.getLogger(__name__)


def eos_ids_of(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    forward_s: float
    forward_calls: int


class TargetRunner:
    """Holds the target model; ``prefill`` / ``forward`` / ``generate`` work on one KV cache."""

    def __init__(self, model: Any, tokenizer: Any, name: str, max_context: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = eos_ids_of(model, tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        model_max = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 32768
        self.max_context = min(max_context, model_max) if max_context else model_max

    @classmethod
    def load(cls, spec: str, dtype: str = "auto", device: str = "auto",
             max_context: int = 0) -> TargetRunner:
        started = time.perf_counter()
        torch_device = pick_device(device)
        model = load_causal_lm(spec, pick_dtype(dtype, torch_device), torch_device)
        runner = cls(model, load_tokenizer(spec), spec, max_context)
        runner.warm_up()
        log.info("loaded target %s (%s, %s) in %.1f s", spec, runner.dtype, runner.device,
                 time.perf_counter() - started)
        return runner

    def warm_up(self) -> None:
        """One small prefill and block forward, so the first client does not pay for kernel
        selection and allocator growth (seconds on CPU for a 1.5B model)."""
        ids = [i % self.vocab_size for i in range(16)]
        self.forward(self.prefill(ids), ids[:5])

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> DynamicCache:
        """A cache holding every prompt token but the last (fed by the first block)."""
        cache = DynamicCache(config=self.model.config)
        if len(prompt_ids) > 1:
            ids = torch.tensor([prompt_ids[:-1]], device=self.device)  # [1, n - 1]
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, token_ids: list[int]) -> torch.Tensor:
        """Append ``token_ids`` to the cache in one forward pass; [n, vocab] float32 logits."""
        ids = torch.tensor([token_ids], device=self.device)  # [1, n]
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[0].float().cpu()  # [n, vocab]

    def generate(self, prompt_ids: list[int], config: SamplingConfig, max_new_tokens: int,
                 seed: int, stop_at_eos: bool) -> GenerationOutput:
        """Target-only autoregressive decoding: the baseline, with the same sampling math."""
        generator = torch.Generator().manual_seed(seed)
        started = time.perf_counter()
        cache = self.prefill(prompt_ids)
        last, generated = prompt_ids[-1], []
        for _ in range(max_new_tokens):
            logits = self.forward(cache, [last])[0]  # [vocab]
            if config.greedy:
                last = int(greedy_tokens(logits).item())
            else:
                probs = process_logits(logits, config).exp()  # [vocab]
                last = sample_from_probs(probs, float(draw_uniforms(generator, 1)[0]))
            generated.append(last)
            if stop_at_eos and last in self.eos_token_ids:
                break
        return GenerationOutput(generated, time.perf_counter() - started, len(generated))

    def crop(self, cache: DynamicCache, keep: int) -> None:
        crop_cache(cache, keep)
