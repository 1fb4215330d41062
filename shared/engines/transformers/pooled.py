"""One forward over the new tokens of many sequences whose KV lives in a slot pool
(``kv_pool.py``), eagerly or through static-shape buckets (``graphs.py``).

The verifier's ``TargetRunner`` serves its sessions with it; the client's pooled drafter
(``pooled_drafter.py``, ``--cuda-graphs``) drafts with it: one slot, one-token steps in a
captured bucket.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.engines.target import ForwardItem
from shared.engines.transformers.graphs import Shaped, StaticForwards
from shared.engines.transformers.kv_pool import KVPool, RaggedBatch, Segment
from shared.protocol.acceptance import tree_depths
from shared.protocol.transfer import Upload


class PoolFullError(RuntimeError):
    """A slot must grow and no region that large is free (callers reserve first: ``reserve``)."""


@torch.inference_mode()
def pooled_forward(model: Any, pool: KVPool, items: list[ForwardItem], device: torch.device,
                   padded: bool = False,
                   static: StaticForwards | None = None) -> list[torch.Tensor | None]:
    """One forward pass over the new tokens of every item (written into their slots); [n, vocab]
    logits rows for the items that asked, on ``device`` in the model's dtype. ``padded``: the
    short segments attend in one call per layer; ``static``: batches that fit a bucket run
    there (views of its output, valid until its next run)."""
    segments: list[Segment] = []
    ids: list[int] = []  # [N] new tokens of all items, flattened
    positions: list[int] = []  # [N] each token's position in its own sequence
    keep: list[int] = []  # indices into ids whose logits are wanted
    shaped: list[Shaped] = []  # the same, for the static-shape forwards
    for item in items:
        offset = len(ids)
        segments.append(Segment.build(item.slot, item.start, offset, len(item.token_ids),
                                      item.tree_parents))
        ids.extend(item.token_ids)
        if item.tree_parents is None:
            at = list(range(item.start, item.start + len(item.token_ids)))
        else:  # a tree node sits at its depth below the root
            at = [item.start, *(item.start + d for d in tree_depths(item.tree_parents))]
        positions.extend(at)
        if item.keep_logits:
            keep.extend(range(offset + item.keep_from, offset + len(item.token_ids)))
        if static is not None:
            shaped.append(Shaped(item.slot, item.start, item.token_ids, at,
                                 segments[-1].visible,
                                 item.keep_from if item.keep_logits else None))
    for item in items:  # a slot's region grows to hold its new tokens
        if not pool.reserve(item.slot, item.start + len(item.token_ids)):
            raise PoolFullError(f"the KV pool has no region of {item.start + len(item.token_ids)}"
                                f" tokens free for slot {item.slot}")
    # A slot twice in one batch (a deferred prompt before its block) runs eagerly.
    if (static is not None and all(s.token_ids for s in shaped)
            and len({s.slot for s in shaped}) == len(shaped)):
        static_rows = static.forward(shaped)
        if static_rows is not None:
            return static_rows
    upload = Upload(device)  # the token ids, positions, kept rows and the layout: one copy
    parts = upload.add(ids), upload.add(positions), upload.add(keep or [0])
    batch = RaggedBatch.plan(pool, segments, device, padded=padded, upload=upload)
    input_ids, position_ids, kept = (upload.get(p) for p in parts)
    out = model(
        input_ids=input_ids[None],  # [1, N]
        position_ids=position_ids[None],  # [1, N]
        use_cache=False,
        logits_to_keep=kept,
        ragged_batch=batch,
    )
    logits = out.logits[0]  # [len(keep), vocab], on the model's device, in its dtype
    rows: list[torch.Tensor | None] = []
    cursor = 0
    for item in items:
        if item.keep_logits:
            n = len(item.token_ids) - item.keep_from
            rows.append(logits[cursor:cursor + n])
            cursor += n
        else:
            rows.append(None)
    return rows
