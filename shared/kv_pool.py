"""A slot pool for the sessions' KV caches, and the ragged attention that reads it in place.

Every session owns one slot: per layer a contiguous [kv_heads, slot_tokens, head_dim] region of
one preallocated tensor. A batched forward flattens the new tokens of all sessions into one
sequence ([1, num_tokens], each token with its own position id); the projections and MLPs run once
for all of them, and every layer writes all new keys and values into their slots in one indexed
copy. Attention then runs in one of two ways (``--attention``):

* ``per-session``: one SDPA call per session over a *view* of its slot (nothing is copied);
* ``padded``: the short segments (verify blocks, decode steps) in ONE call per layer - queries
  padded to the longest block, keys and values gathered from the slots' first E positions, a
  [B, 1, L, E] mask - and only long prefills one by one. One kernel launch instead of B, and
  the shapes depend on (B, L, E) alone, which is what a GPU wants.

Rolling back a rejected draft is moving the session's length; nothing is erased.

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


# Segments up to this many new tokens (verify blocks, decode steps) attend together in one padded
# call per layer; longer ones (prefills) attend on their own, so one long prompt does not pad
# every short block of its batch to its length.
PADDED_MAX_LENGTH = 64


def fill_mask(mask: torch.Tensor,
              rows: list[tuple[int, int, torch.Tensor | None]]) -> None:
    """mask: [B, 1, L, E]; rows[b] = (start, length, visible) of segment b (visible: [length,
    start + length], or None: each token sees everything up to itself). Pad rows (and padding
    segments past len(rows)) see key 0 alone, so they stay finite; their outputs are dropped."""
    mask.zero_()
    mask[..., 0] = True
    for b, (start, length, visible) in enumerate(rows):
        seen = start + length
        if visible is not None:
            mask[b, 0, :length, :seen] = visible.to(mask.device)
        else:
            mask[b, 0, :length, :seen] = True


@dataclass(frozen=True)
class PaddedGroup:
    """Short segments attended in one call: queries padded to [B, L], keys and values gathered
    from the first E positions of their slots, a [B, 1, L, E] mask saying who sees what."""

    slots: torch.Tensor  # [B] slot ids
    query_index: torch.Tensor  # [B, L] each padded query's token in the flat batch (pad: 0)
    token_index: torch.Tensor  # [n] the group's tokens in the flat batch
    token_rows: torch.Tensor  # [n] where each of them sits in the padded [B * L] output
    mask: torch.Tensor  # [B, 1, L, E]
    end: int  # E, the longest slot prefix read

    @classmethod
    def build(cls, segments: list[Segment], device: torch.device) -> PaddedGroup:
        length = max(seg.length for seg in segments)
        end = max(seg.start + seg.length for seg in segments)
        # Built where the segments' masks already are: no copy back to the host (a GPU sync).
        mask = torch.empty(len(segments), 1, length, end, dtype=torch.bool, device=device)
        fill_mask(mask, [(seg.start, seg.length, seg.visible) for seg in segments])
        query_index = torch.zeros(len(segments), length, dtype=torch.long)
        token_index: list[int] = []
        token_rows: list[int] = []
        for b, seg in enumerate(segments):
            tokens = range(seg.offset, seg.offset + seg.length)
            query_index[b, :seg.length] = torch.tensor(tokens)
            token_index.extend(tokens)
            token_rows.extend(range(b * length, b * length + seg.length))
        return cls(torch.tensor([seg.slot for seg in segments], device=device),
                   query_index.to(device), torch.tensor(token_index, device=device),
                   torch.tensor(token_rows, device=device), mask, end)


@dataclass(frozen=True)
class RaggedBatch:
    """The flattened batch's layout, built once per forward and read by every layer."""

    pool: KVPool
    write_slots: torch.Tensor  # [N] each new token's slot
    write_positions: torch.Tensor  # [N] and its position there
    alone: list[Segment]  # attended one by one (all of them without ``padded``)
    padded: PaddedGroup | None

    @classmethod
    def plan(cls, pool: KVPool, segments: list[Segment], device: torch.device,
             padded: bool) -> RaggedBatch:
        """``padded``: short segments (two or more) attend in one padded call per layer."""
        slots = [seg.slot for seg in segments for _ in range(seg.length)]
        positions = [seg.start + i for seg in segments for i in range(seg.length)]
        short = [seg for seg in segments if seg.length <= PADDED_MAX_LENGTH] if padded else []
        if len(short) < 2:
            short = []
        alone = [seg for seg in segments if seg not in short]
        group = PaddedGroup.build(short, device) if short else None
        return cls(pool, torch.tensor(slots, device=device),
                   torch.tensor(positions, device=device), alone, group)


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
        if parents == list(range(len(slots))):
            return
        for cache in (*self.keys, *self.values):
            dst = torch.tensor(slots, device=cache.device)
            src = torch.tensor([slots[p] for p in parents], device=cache.device)
            cache[dst, :, :length] = cache[src, :, :length]  # the gather copies before writing

    def compact(self, slot: int, sources: list[int], targets: list[int]) -> None:
        """Move cached positions ``sources`` of ``slot`` to ``targets`` (a token tree's accepted
        path, to where a chain would have put it)."""
        if sources == targets:
            return
        for cache in (*self.keys, *self.values):
            src = torch.tensor(sources, device=cache.device)
            dst = torch.tensor(targets, device=cache.device)
            cache[slot, :, dst] = cache[slot, :, src]  # the gather copies before writing


def ragged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, ragged_batch: RaggedBatch | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query: [1, heads, N, head_dim]; key / value: [1, kv_heads, N, head_dim] for the N new
    tokens of all segments. Returns [1, N, heads, head_dim]."""
    if ragged_batch is None:
        raise RuntimeError("the specdec_ragged attention needs a ragged_batch argument")
    layer = module.layer_idx
    return _planned_attention(ragged_batch, ragged_batch.pool.keys[layer],
                              ragged_batch.pool.values[layer], query, key, value, scaling)


def _planned_attention(batch: RaggedBatch, keys: torch.Tensor, values: torch.Tensor,
                       query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float | None) -> tuple[torch.Tensor, None]:
    """One write of every new K/V into the slots, then the padded group in one call and the
    long segments one by one. Shapes as in ``ragged_attention``."""
    device = keys.device
    if query.device != device:  # a model over several devices: this layer's slots are here
        query, key, value = query.to(device), key.to(device), value.to(device)
    slots, positions = batch.write_slots.to(device), batch.write_positions.to(device)
    keys[slots, :, positions] = key[0].transpose(0, 1)  # [N, kv_heads, head_dim]
    values[slots, :, positions] = value[0].transpose(0, 1)
    heads, num_tokens, head_dim = query.shape[1:]
    out = query.new_empty(num_tokens, heads, head_dim)  # [N, heads, head_dim]
    for seg in batch.alone:
        new = slice(seg.offset, seg.offset + seg.length)
        end = seg.start + seg.length
        mask = seg.visible.to(device) if seg.visible is not None else None
        out[new] = F.scaled_dot_product_attention(
            query[:, :, new], keys[seg.slot, :, :end][None], values[seg.slot, :, :end][None],
            attn_mask=mask, scale=scaling, enable_gqa=True)[0].transpose(0, 1)
    group = batch.padded
    if group is not None:
        q = query[0][:, group.query_index.to(device)].transpose(0, 1)  # [B, heads, L, head_dim]
        slot_ids = group.slots.to(device)
        o = F.scaled_dot_product_attention(
            q, keys[slot_ids, :, :group.end], values[slot_ids, :, :group.end],  # [B, kv, E, d]
            attn_mask=group.mask.to(device), scale=scaling, enable_gqa=True)  # [B, heads, L, d]
        flat = o.transpose(1, 2).reshape(-1, heads, head_dim)  # [B * L, heads, head_dim]
        out[group.token_index.to(device)] = flat[group.token_rows.to(device)]
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, ragged_attention)
