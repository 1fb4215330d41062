"""Encoder-decoder targets (T5, BART, Marian, ...): per-session state instead of the slot pool.

A session's "slot" holds its encoder output (computed once, when the session is created from its
``encoder_ids``) and a transformers ``EncoderDecoderCache``: the decoder's self-attention K/V,
which grows with the decoder tokens and is cropped back when drafts are rejected, and the
cross-attention K/V over the encoder output, computed on the first decoder forward and reused.

Forwards run one session at a time: concurrent sessions' jobs still share the scheduler's batches
(one model-thread step), but each scores its block in its own decoder forward. Mixing
encoder-decoder sessions in one ragged forward would need a ragged cross-attention too; the
decoder forward of a block is small next to what batching would save only at high concurrency.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from shared.engines import DEFAULT_KV_BUDGET
from shared.engines.target import BatchForward, ForwardItem, PoolSlots, SlotAllocator
from shared.engines.transformers.kv_cache import crop_cache, with_cache
from shared.engines.transformers.models import describe_model, input_device


@dataclass
class Seq2SeqState:
    encoder_outputs: Any  # the encoder's BaseModelOutput for this session's encoder_ids
    cache: EncoderDecoderCache


class Seq2SeqPool(SlotAllocator):
    """The slots of encoder-decoder targets: ``num_slots`` per-session states."""

    def __init__(self, num_slots: int, slot_tokens: int) -> None:
        super().__init__(num_slots, slot_tokens)
        self.states: list[Seq2SeqState | None] = [None] * num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the sessions' caches and encoder outputs right now."""
        total = 0
        for state in self.states:
            if state is None:
                continue
            tensors = [state.encoder_outputs.last_hidden_state]
            for part in (state.cache.self_attention_cache, state.cache.cross_attention_cache):
                for layer in getattr(part, "layers", []):
                    tensors += [t for t in (getattr(layer, "keys", None),
                                            getattr(layer, "values", None)) if t is not None]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def release(self, slot: int) -> None:
        super().release(slot)
        self.states[slot] = None

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        """Slot j takes a copy of slot parents[j]'s state, cut to ``length`` decoder positions
        (beam search). The encoder output is shared: it never changes."""
        if parents == list(range(len(slots))):
            return
        sources = [self.states[slots[p]] for p in parents]
        copies: list[Seq2SeqState | None] = []
        for state in sources:
            assert state is not None
            cache = copy.deepcopy(state.cache)
            crop_cache(cache, length)
            copies.append(Seq2SeqState(state.encoder_outputs, cache))
        for slot, state in zip(slots, copies, strict=True):
            self.states[slot] = state


class Seq2SeqEngine(PoolSlots, BatchForward):
    """An encoder-decoder target over per-session states (no token trees)."""

    trees = False

    def __init__(self, model: Any, tokenizer: Any, name: str, max_context: int = 0,
                 kv_budget_tokens: int = DEFAULT_KV_BUDGET, acceptance: str = "device") -> None:
        self.model = model
        self.acceptance = acceptance
        self.device = input_device(model)
        self.info, num_slots = describe_model(model, tokenizer, name, max_context,
                                              kv_budget_tokens, self.device)
        self.pool = Seq2SeqPool(num_slots, self.info.max_context)

    def counters(self) -> dict[str, int]:
        return {}

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        raise NotImplementedError("token trees are refused for encoder-decoder targets")

    def warm_up(self) -> None:
        """One small encode and decode, so the first client does not pay for them."""
        slot = self.pool.allocate()
        if slot is None:
            return
        ids = [i % self.info.vocab_size for i in range(16)]
        self.forward([ForwardItem(slot, 0, ids, False, ids)])
        self.forward([ForwardItem(slot, 16, ids[:5], True)])
        self.pool.release(slot)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        """Each item: encode (when it carries ``encoder_ids``: a new session), crop the decoder
        cache to ``start`` (drafts rejected last time), then one decoder forward over its
        tokens."""
        rows: list[torch.Tensor | None] = []
        for item in items:
            if item.encoder_ids is not None:
                encoded = self.model.get_encoder()(
                    input_ids=torch.tensor([item.encoder_ids], device=self.device))
                self.pool.states[item.slot] = Seq2SeqState(
                    encoded, EncoderDecoderCache(DynamicCache(), DynamicCache()))
            state = self.pool.states[item.slot]
            assert state is not None, f"slot {item.slot} holds no session"
            crop_cache(state.cache, item.start)
            if not item.token_ids:
                rows.append(None)
                continue
            out = self.model(encoder_outputs=state.encoder_outputs,
                             decoder_input_ids=torch.tensor([item.token_ids], device=self.device),
                             **with_cache(self.model, state.cache))
            rows.append(out.logits[0] if item.keep_logits else None)  # [n, vocab]
        return rows
