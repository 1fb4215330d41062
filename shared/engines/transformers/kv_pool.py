"""A pool for the sessions' KV caches, and the ragged attention that reads it in place.

Every layer's cache is ONE preallocated [kv_heads, total_tokens, head_dim] tensor. A session
owns a *slot*: a stable id whose *region* - a contiguous run of that token axis - grows with it.
The axis is cut into slabs of the longest context (``slot_tokens``), and regions come from a
buddy allocator inside each slab (:class:`Regions`): 256, 512, 1024, ... tokens, or a whole slab.
So short sessions hold short regions and many more sessions fit than one longest-context slot
each, while the pool still holds ``total_tokens // slot_tokens`` sessions at their longest. A
session that outgrows its region takes the room after it when that is free, or moves to a
larger region (one copy per layer, far cheaper than the forward that needed the room); its slot
id stays.

A batched forward flattens the new tokens of all sessions into one sequence ([1, num_tokens],
each token with its own position id); the projections and MLPs run once for all of them, and
every layer writes all new keys and values into their regions in one indexed copy. Attention
then runs in one of two ways (``--attention``):

* ``per-session``: one SDPA call per session over a *view* of its region (nothing is copied);
* ``padded``: the short segments (verify blocks, decode steps) in ONE call per layer - queries
  padded to the longest block, keys and values gathered from the regions' first E positions, a
  [B, 1, L, E] mask - and only long prefills one by one. One kernel launch instead of B, and
  the shapes depend on (B, L, E) alone, which is what a GPU wants.

Every index a forward needs goes to the device in ONE copy from one (pinned, on CUDA) host
tensor (:class:`Upload`), and the masks are computed there from each segment's start and length:
no host sync per segment or per layer. Masked calls fold a grouped-query head group into the
query rows ([B, kv_heads, group * L, d]) instead of passing ``enable_gqa``, so SDPA keeps its
fused kernels (``enable_gqa`` with a mask rules out flash and may fall back to the math kernel,
which copies K/V per query head); prefills pass ``is_causal``.

Rolling back a rejected draft is moving the session's length; nothing is erased.

The attention function is registered with transformers' AttentionInterface under the name
``specdec_ragged`` when a model first uses it (:func:`use_ragged_attention`; importing this module
does not import transformers' modelling code, which takes seconds: a llama.cpp verifier never
needs it); transformers skips its own mask building for such custom functions, and passes our
``ragged_batch`` keyword through to every attention call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.engines.transformers.kv_regions import Regions
from shared.protocol.transfer import Upload

ATTENTION_NAME = "specdec_ragged"
SMALLEST_REGION = 256  # tokens: the first region of every session


def head_layout(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


@dataclass(frozen=True)
class Segment:
    """One session's new tokens in a flattened batch."""

    slot: int
    start: int  # tokens already in the slot (the new ones go at start .. start + length - 1)
    offset: int  # where the new tokens begin in the flattened batch
    length: int
    visible: torch.Tensor | None = None  # a tree's [length, start + length] mask (host); None:
    # each token sees the cached prefix and the new tokens up to itself

    @classmethod
    def build(cls, slot: int, start: int, offset: int, length: int,
              tree_parents: list[int] | None = None) -> Segment:
        """``tree_parents``: the new tokens after the first form a tree below it (parent -1 is
        the first token): each sees the cached prefix, its ancestors and itself."""
        visible = None
        if tree_parents is not None:
            sees = torch.eye(length, dtype=torch.bool)  # [length, length]
            sees[:, 0] = True  # the root: every node descends from it
            for node, parent in enumerate(tree_parents, start=1):
                sees[node] |= sees[parent + 1]
            prefix = torch.ones(length, start, dtype=torch.bool)
            visible = torch.cat([prefix, sees], dim=1)  # [length, start + length]
        return cls(slot, start, offset, length, visible)


# Segments up to this many new tokens (verify blocks, decode steps) attend together in one padded
# call per layer; longer ones (prefills) attend on their own, so one long prompt does not pad
# every short block of its batch to its length.
PADDED_MAX_LENGTH = 64
KEY_ALIGN = 16  # a padded group reads a multiple of this many key positions


def chain_mask(starts: torch.Tensor, lengths: torch.Tensor, length: int,
               end: int) -> torch.Tensor:
    """[B, 1, L, E] on the device of ``starts`` / ``lengths`` ([B] each): query l of segment b
    sees keys 0 .. start_b + l when l < length_b; pad rows (and segments of length 0) see key 0
    alone, so they stay finite (their outputs are dropped)."""
    device = starts.device
    rows = torch.arange(length, device=device)  # [L]
    keys = torch.arange(end, device=device)  # [E]
    last = (starts[:, None] + rows[None, :])[:, :, None]  # [B, L, 1]: the last key each sees
    real = (rows[None, :] < lengths[:, None])[:, :, None]  # [B, L, 1]
    mask = ((keys[None, None, :] <= last) & real) | (keys == 0)[None, None, :]
    return mask[:, None]  # [B, 1, L, E]


def key_positions(bases: torch.Tensor, end: int, total: int) -> torch.Tensor:
    """[B, E] flat cache index of positions 0 .. E - 1 of the regions starting at ``bases``
    ([B], on the device); past the cache's end (masked: never seen) clamped into it."""
    return (bases[:, None] + torch.arange(end, device=bases.device)[None, :]).clamp_(
        max=total - 1)


def patch_trees(mask: torch.Tensor, trees: list[tuple[int, torch.Tensor]]) -> None:
    """Tree segments' rows of a [B, 1, L, E] mask: (b, visible) each, visible a host
    [length, start + length] bool mask (a copy per tree; chains need none)."""
    for b, visible in trees:
        length, seen = visible.shape
        mask[b, 0, :length, :seen] = visible.to(mask.device)


@dataclass(frozen=True)
class PaddedGroup:
    """Short segments attended in one call: queries padded to [B, L], keys and values gathered
    from the first E positions of their regions, a [B, 1, L, E] mask saying who sees what."""

    gather: torch.Tensor  # [B, E] flat cache index of each segment's key positions 0 .. E - 1
    query_index: torch.Tensor  # [B, L] each padded query's token in the flat batch (pad: 0)
    token_index: torch.Tensor  # [n] the group's tokens in the flat batch
    token_rows: torch.Tensor  # [n] where each of them sits in the padded [B * L] output
    mask: torch.Tensor  # [B, 1, L, E]
    end: int  # E, the longest slot prefix read

    @classmethod
    def plan(cls, pool: KVPool, segments: list[Segment], upload: Upload) -> Any:
        """Queue the group's indices on ``upload``; after ``upload.send()``, call the returned
        function for the group (one copy for the whole forward)."""
        length = max(seg.length for seg in segments)
        # a multiple of KEY_ALIGN: fused kernels want the mask's rows aligned (the extra keys
        # are masked)
        end = -(-max(seg.start + seg.length for seg in segments) // KEY_ALIGN) * KEY_ALIGN
        query_index: list[int] = []
        token_index: list[int] = []
        token_rows: list[int] = []
        for b, seg in enumerate(segments):
            tokens = list(range(seg.offset, seg.offset + seg.length))
            query_index.extend(tokens + [0] * (length - seg.length))
            token_index.extend(tokens)
            token_rows.extend(range(b * length, b * length + seg.length))
        parts = [upload.add(values) for values in (
            [pool.base(seg.slot) for seg in segments], query_index, token_index,
            token_rows, [seg.start for seg in segments], [seg.length for seg in segments])]
        trees = [(b, seg.visible) for b, seg in enumerate(segments)
                 if seg.visible is not None]

        def build() -> PaddedGroup:
            bases, queries, tokens, rows, starts, lengths = (upload.get(p) for p in parts)
            mask = chain_mask(starts, lengths, length, end)
            patch_trees(mask, trees)
            return cls(key_positions(bases, end, pool.regions.total),
                       queries.view(len(segments), length),
                       tokens, rows, mask, end)
        return build


@dataclass(frozen=True)
class Alone:
    """A segment attended on its own: its query rows, the view of its region it reads, and its
    mask (None: a prefill from position 0, attended with ``is_causal``)."""

    rows: slice  # its tokens in the flat batch
    base: int  # its region's first token in the cache
    end: int  # keys read: base .. base + end
    mask: torch.Tensor | None  # [length, end] on the device


@dataclass(frozen=True)
class RaggedBatch:
    """The flattened batch's layout, built once per forward and read by every layer."""

    pool: KVPool
    write_index: torch.Tensor  # [N] each new token's flat index in the cache
    alone: list[Alone]  # attended one by one (all of them without ``padded``)
    padded: PaddedGroup | None

    @classmethod
    def plan(cls, pool: KVPool, segments: list[Segment], device: torch.device,
             padded: bool, upload: Upload | None = None) -> RaggedBatch:
        """``padded``: short segments (two or more) attend in one padded call per layer.
        ``upload``: the forward's other integers (token ids, positions) ride in the same copy;
        it is sent here."""
        upload = upload or Upload(device)
        writes = upload.add([pool.base(seg.slot) + seg.start + i
                             for seg in segments for i in range(seg.length)])
        short = [seg for seg in segments if seg.length <= PADDED_MAX_LENGTH] if padded else []
        if len(short) < 2:
            short = []
        group = PaddedGroup.plan(pool, short, upload) if short else None
        upload.send()
        alone = [Alone(slice(seg.offset, seg.offset + seg.length), pool.base(seg.slot),
                       seg.start + seg.length, _alone_mask(seg, device))
                 for seg in segments if seg not in short]
        return cls(pool, upload.get(writes), alone, group() if group else None)


def _alone_mask(seg: Segment, device: torch.device) -> torch.Tensor | None:
    if seg.visible is not None:
        return seg.visible.to(device)
    if seg.start == 0:
        return None  # is_causal
    last = torch.arange(seg.length, device=device) + seg.start  # [length]
    return torch.arange(seg.start + seg.length, device=device)[None, :] <= last[:, None]


class KVPool:
    """Slots for every layer of one model: ids handed out and taken back, each with a region of
    the token axis that grows on demand (:meth:`reserve`) up to ``slot_tokens``."""

    def __init__(self, config: Any, num_slots: int, slot_tokens: int, dtype: torch.dtype,
                 device: torch.device | list[torch.device], tp_size: int = 1,
                 total_tokens: int | None = None) -> None:
        """``total_tokens`` (default ``num_slots * slot_tokens``) is the pool's size; as many
        slots as smallest regions fit. ``device``: one for all layers, or one per layer (a model
        placed over several); ``tp_size``: ranks sharing the KV heads (tensor parallelism; this
        rank holds its share)."""
        _, kv_heads, head_dim = head_layout(config)
        kv_heads //= tp_size
        total = total_tokens if total_tokens is not None else num_slots * slot_tokens
        self.regions = Regions(max(total, slot_tokens), min(SMALLEST_REGION, slot_tokens),
                               slot_tokens)
        self.slot_tokens = slot_tokens
        shape = (kv_heads, self.regions.total, head_dim)
        layers = config.num_hidden_layers
        devices = device if isinstance(device, list) else [device] * layers
        self.keys = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.values = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.num_slots = self.regions.free_tokens // self.regions.smallest
        self._free_ids = list(range(self.num_slots - 1, -1, -1))
        self._region: dict[int, tuple[int, int]] = {}  # slot -> (base, order)
        self.moves = 0  # regions outgrown and moved

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def free_slots(self) -> int:
        """Sessions that could still open (each takes a smallest region)."""
        return min(len(self._free_ids), self.regions.free_tokens // self.regions.smallest)

    def allocate(self) -> int | None:
        """A slot with a smallest region, or None when the pool is full."""
        if not self._free_ids:
            return None
        base = self.regions.allocate(0)
        if base is None:
            return None
        slot = self._free_ids.pop()
        self._region[slot] = (base, 0)
        return slot

    def release(self, slot: int) -> None:
        region = self._region.pop(slot, None)
        if region is None:
            raise ValueError(f"slot {slot} is already free")
        self.regions.release(*region)
        self._free_ids.append(slot)

    def base(self, slot: int) -> int:
        return self._region[slot][0]

    def capacity(self, slot: int) -> int:
        return self.regions.size(self._region[slot][1])

    def reserve(self, slot: int, tokens: int) -> bool:
        """Make ``slot`` hold ``tokens`` tokens, moving it to a larger region (its cached
        tokens copied) when it must; False when ``tokens`` is past ``slot_tokens`` or no
        region that large is free (the slot is unchanged)."""
        if tokens > self.slot_tokens:
            return False
        base, order = self._region[slot]
        if tokens <= self.regions.size(order):
            return True
        wanted = self.regions.order_for(tokens)
        if wanted is None:
            return False
        if self.regions.grow(base, order, wanted):  # the room right after it was free
            self._region[slot] = (base, wanted)
            return True
        # Free it first (its tokens stay where they are until written), so the larger region
        # may be the one it sits in; taken back as it was when none is free.
        self.regions.release(base, order)
        moved = self.regions.allocate(wanted)
        if moved is None:
            self.regions.take(base, order)
            return False
        size = self.regions.size(order)
        overlap = moved < base + size and base < moved + self.regions.size(wanted)
        for cache in (*self.keys, *self.values) if moved != base else ():
            old = cache[:, base:base + size]
            cache[:, moved:moved + size] = old.clone() if overlap else old
        self._region[slot] = (moved, wanted)
        self.moves += 1
        return True

    def region(self, cache: torch.Tensor, slot: int) -> torch.Tensor:
        """[kv_heads, capacity, head_dim]: a view of ``slot``'s region of one layer's cache."""
        base, order = self._region[slot]
        return cache[:, base:base + self.regions.size(order)]

    def _copy(self, dst: list[int], src: list[int]) -> None:
        """cache[:, dst] = cache[:, src] in every layer (the gather copies before writing);
        the indices go to each device once."""
        by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for cache in (*self.keys, *self.values):
            if cache.device not in by_device:
                upload = Upload(cache.device)
                parts = upload.add(dst), upload.add(src)
                upload.send()
                by_device[cache.device] = (upload.get(parts[0]), upload.get(parts[1]))
            to, from_ = by_device[cache.device]
            cache[:, to] = cache[:, from_]

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        """Slot j takes the first ``length`` cached positions of slot parents[j] (beam search
        following its parents); every slot must hold ``length`` tokens (:meth:`reserve`)."""
        if parents == list(range(len(slots))):
            return
        for slot in slots:
            if not self.reserve(slot, length):
                raise RuntimeError(f"KV pool full: slot {slot} cannot hold {length} tokens")
        self._copy([self.base(s) + i for s in slots for i in range(length)],
                   [self.base(slots[p]) + i for p in parents for i in range(length)])

    def compact(self, slot: int, sources: list[int], targets: list[int]) -> None:
        """Move cached positions ``sources`` of ``slot`` to ``targets`` (a token tree's accepted
        path, to where a chain would have put it)."""
        if sources == targets:
            return
        base = self.base(slot)
        self._copy([base + t for t in targets], [base + s for s in sources])


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


def _sdpa_arguments(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The query and keyword arguments of the SDPA call ``grouped_attention`` makes."""
    b, heads, length, dim = query.shape
    kv_heads = keys.shape[1]
    if mask is None:
        return query, {"is_causal": True, "scale": scaling, "enable_gqa": heads != kv_heads}
    group = heads // kv_heads
    if group > 1:  # query head h reads kv head h // group
        query = query.reshape(b, kv_heads, group * length, dim)
        mask = mask.view(-1, 1, 1, length, mask.shape[-1]).expand(
            -1, 1, group, length, mask.shape[-1]).reshape(-1, 1, group * length, mask.shape[-1])
    return query, {"attn_mask": mask, "scale": scaling}


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """SDPA of query [B, heads, L, d] over keys / values [B, kv_heads, E, d] with mask
    [B, 1, L, E] (or [L, E]), a grouped-query head group folded into the query rows (no
    ``enable_gqa``, which keeps the fused kernels); None: causal (a prefill from position 0).
    Returns [B, heads, L, d]."""
    folded, kwargs = _sdpa_arguments(query, keys, mask, scaling)
    out = F.scaled_dot_product_attention(folded, keys, values, **kwargs)
    return out.reshape(query.shape)


def sdpa_backend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 **kwargs: Any) -> str:
    """The kernel PyTorch's dispatcher picks for this SDPA call (FLASH_ATTENTION,
    EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH, ...), from its own choice function (a private
    API: "unknown" where it is missing or refuses)."""
    from torch.nn.attention import SDPBackend

    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    try:
        choice = torch._fused_sdp_choice(  # type: ignore[attr-defined]
            query, keys, values, attn_mask=kwargs.get("attn_mask"), dropout_p=0.0,
            is_causal=bool(kwargs.get("is_causal", False)), scale=kwargs.get("scale"),
            enable_gqa=bool(kwargs.get("enable_gqa", False)))
    except (AttributeError, RuntimeError, TypeError):
        return "unknown"
    return names.get(int(choice), "unknown")


def attention_kernels(config: Any, dtype: torch.dtype, device: torch.device, batch: int = 8,
                      length: int = 5, end: int = 512) -> dict[str, str]:
    """Which SDPA kernel each kind of call of the ragged attention runs for this model's head
    layout: a padded group of ``batch`` blocks of ``length`` over ``end`` keys, one block alone,
    a decode step, a prefill; and, for comparison, the masked call with ``enable_gqa`` that the
    folding replaces."""
    heads, kv_heads, dim = head_layout(config)

    def probe(b: int, n: int, e: int, masked: bool) -> str:
        q = torch.zeros(b, heads, n, dim, dtype=dtype, device=device)
        k = torch.zeros(b, kv_heads, e, dim, dtype=dtype, device=device)
        mask = torch.ones(b, 1, n, e, dtype=torch.bool, device=device) if masked else None
        folded, kwargs = _sdpa_arguments(q, k, mask, None)
        return sdpa_backend(folded, k, k, **kwargs)

    q = torch.zeros(batch, heads, length, dim, dtype=dtype, device=device)
    k = torch.zeros(batch, kv_heads, end, dim, dtype=dtype, device=device)
    unfolded = sdpa_backend(q, k, k, attn_mask=torch.ones(batch, 1, length, end, dtype=torch.bool,
                                                          device=device),
                            enable_gqa=heads != kv_heads)
    return {"padded_group": probe(batch, length, end, True),
            "block_alone": probe(1, length, end, True), "decode_step": probe(1, 1, end, True),
            "block_alone_odd_end": probe(1, length, end - 3, True),
            "prefill": probe(1, end, end, False), "masked_enable_gqa": unfolded}


def _planned_attention(batch: RaggedBatch, keys: torch.Tensor, values: torch.Tensor,
                       query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float | None) -> tuple[torch.Tensor, None]:
    """One write of every new K/V into the regions, then the padded group in one call and the
    long segments one by one. Shapes as in ``ragged_attention``; keys / values: one layer's
    [kv_heads, total_tokens, head_dim] cache."""
    device = keys.device
    if query.device != device:  # a model over several devices: this layer's cache is here
        query, key, value = query.to(device), key.to(device), value.to(device)
    write = batch.write_index.to(device)
    keys[:, write] = key[0]  # [kv_heads, N, head_dim]
    values[:, write] = value[0]
    heads, num_tokens, head_dim = query.shape[1:]
    out = query.new_empty(num_tokens, heads, head_dim)  # [N, heads, head_dim]
    for seg in batch.alone:
        span = slice(seg.base, seg.base + seg.end)
        out[seg.rows] = grouped_attention(
            query[:, :, seg.rows], keys[None, :, span], values[None, :, span],
            None if seg.mask is None else seg.mask.to(device), scaling)[0].transpose(0, 1)
    group = batch.padded
    if group is not None:
        q = query[0][:, group.query_index.to(device)].transpose(0, 1)  # [B, heads, L, head_dim]
        gather = group.gather.to(device)  # [B, E]
        o = grouped_attention(q, keys[:, gather].transpose(0, 1),  # [B, kv_heads, E, d]
                              values[:, gather].transpose(0, 1), group.mask.to(device),
                              scaling)  # [B, heads, L, d]
        flat = o.transpose(1, 2).reshape(-1, heads, head_dim)  # [B * L, heads, head_dim]
        out[group.token_index.to(device)] = flat[group.token_rows.to(device)]
    return out[None], None


def use_ragged_attention(model: Any) -> None:
    """Run ``model``'s attention through :func:`ragged_attention` (registered on first use)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ragged_attention)
    model.set_attn_implementation(ATTENTION_NAME)
