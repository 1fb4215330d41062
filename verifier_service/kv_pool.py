"""A slot pool for the sessions' KV caches, and the ragged attention that reads it in place.

Every session owns one slot: per layer a contiguous [kv_heads, slot_tokens, head_dim] region of
one preallocated tensor. A batched forward flattens the new tokens of all sessions into one
sequence ([1, num_tokens], each token with its own position id); the projections and MLPs run once
for all of them, and attention runs per session over a *view* of its slot, so no session's cache
is copied. Rolling back a rejected draft is moving the session's length; nothing is erased.

The attention function is registered with transformers' AttentionInterface under the name
``specdec_ragged``; transformers skips its own mask building for such custom functions, and passes
our ``ragged_batch`` keyword through to every attention call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "specdec_ragged"


@dataclass(frozen=True)
class Segment:
    """One session's new tokens in a flattened batch."""

    slot: int
    start: int  # tokens already in the slot (the new ones go at start .. start + length - 1)
    offset: int  # where the new tokens begin in the flattened batch
    length: int
    visible: torch.Tensor | None = None  # [length, start + length] causal mask; None: all

    @classmethod
    def build(cls, slot: int, start: int, offset: int, length: int, device: torch.device,
              tree_parents: list[int] | None = None) -> Segment:
        """The mask is the same for every layer, so it is built once per forward.
        ``tree_parents``: the new tokens after the first form a tree below it (parent -1 is the
        first token): each sees the cached prefix, its ancestors and itself."""
        visible = None
        if tree_parents is not None:
            sees = torch.eye(length, dtype=torch.bool)  # [length, length]
            sees[:, 0] = True  # the root: every node descends from it
            for node, parent in enumerate(tree_parents, start=1):
                sees[node] |= sees[parent + 1]
            prefix = torch.ones(length, start, dtype=torch.bool)
            visible = torch.cat([prefix, sees], dim=1).to(device)  # [length, start + length]
        elif length > 1:
            seen = torch.arange(start + length, device=device)  # [end]
            rows = start + torch.arange(length, device=device)  # [length]
            visible = seen[None, :] <= rows[:, None]  # [length, end]
        return cls(slot, start, offset, length, visible)


@dataclass(frozen=True)
class RaggedBatch:
    pool: KVPool
    segments: list[Segment]


class SlotAllocator:
    """``num_slots`` slot ids of ``slot_tokens`` positions each, handed out and taken back."""

    def __init__(self, num_slots: int, slot_tokens: int) -> None:
        self.num_slots, self.slot_tokens = num_slots, slot_tokens
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self._free.append(slot)


class KVPool(SlotAllocator):
    """``num_slots`` slots of ``slot_tokens`` positions for every layer of one model."""

    def __init__(self, config: Any, num_slots: int, slot_tokens: int, dtype: torch.dtype,
                 device: torch.device | list[torch.device], tp_size: int = 1) -> None:
        """``device``: one for all layers, or one per layer (a model placed over several);
        ``tp_size``: ranks sharing the KV heads (tensor parallelism; this rank holds its share).
        """
        self.lockstep: Any = None  # tensor parallel: reorders are announced to the other ranks
        heads = config.num_attention_heads
        kv_heads = (getattr(config, "num_key_value_heads", None) or heads) // tp_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (num_slots, kv_heads, slot_tokens, head_dim)
        layers = config.num_hidden_layers
        devices = device if isinstance(device, list) else [device] * layers
        self.keys = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.values = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        super().__init__(num_slots, slot_tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        """Slot j takes the first ``length`` cached positions of slot parents[j] (beam search
        following its parents)."""
        if self.lockstep is not None:
            self.lockstep.announce("reorder", slots, parents, length)
        self.local_reorder(slots, parents, length)

    def compact(self, slot: int, sources: list[int], targets: list[int]) -> None:
        """Move cached positions ``sources`` of ``slot`` to ``targets`` (a token tree's accepted
        path, to where a chain would have put it)."""
        if self.lockstep is not None:
            self.lockstep.announce("compact", slot, sources, targets)
        self.local_compact(slot, sources, targets)

    def local_compact(self, slot: int, sources: list[int], targets: list[int]) -> None:
        if sources == targets:
            return
        for cache in (*self.keys, *self.values):
            src = torch.tensor(sources, device=cache.device)
            dst = torch.tensor(targets, device=cache.device)
            cache[slot, :, dst] = cache[slot, :, src]  # the gather copies before writing

    def local_reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        if parents == list(range(len(slots))):
            return
        for cache in (*self.keys, *self.values):
            dst = torch.tensor(slots, device=cache.device)
            src = torch.tensor([slots[p] for p in parents], device=cache.device)
            cache[dst, :, :length] = cache[src, :, :length]  # the gather copies before writing


def ragged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, ragged_batch: RaggedBatch | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query: [1, heads, N, head_dim]; key / value: [1, kv_heads, N, head_dim] for the N new
    tokens of all segments. Returns [1, N, heads, head_dim]."""
    if ragged_batch is None:
        raise RuntimeError("the specdec_ragged attention needs a ragged_batch argument")
    layer = module.layer_idx
    keys, values = ragged_batch.pool.keys[layer], ragged_batch.pool.values[layer]
    outputs = []
    for seg in ragged_batch.segments:
        new = slice(seg.offset, seg.offset + seg.length)
        end = seg.start + seg.length
        keys[seg.slot, :, seg.start:end] = key[0, :, new]  # write the new K/V into the slot
        values[seg.slot, :, seg.start:end] = value[0, :, new]
        mask = seg.visible
        if mask is not None and mask.device != query.device:  # a model over several devices
            mask = mask.to(query.device)
        out = F.scaled_dot_product_attention(
            query[:, :, new], keys[seg.slot, :, :end][None], values[seg.slot, :, :end][None],
            attn_mask=mask, scale=scaling, enable_gqa=True,
        )  # [1, heads, length, head_dim]
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, ragged_attention)
