"""A model drafter for a GPU client (``--cuda-graphs``): its KV cache in a preallocated slot and
its one-token steps in a static-shape bucket, captured once as a CUDA graph and replayed.

On a GPU an eager drafter step is launch-bound (one kernel launch per op, whatever the model's
size), so an eager small drafter costs nearly what the target's forward does (figures:
docs/benchmarks.md, GPU section). This drafter runs on the verifier's engine
(``pooled.py``): one slot of a ``KVPool`` for the drafted sequence (plus the buckets'
scratch slot), attention over the slot in place, and rollback by moving a length instead of
cropping a ``DynamicCache``.

Greedy chains never leave the device while they are drafted: each step's argmax is fed to the
next step as a device tensor, and the k ids come back to the host in one copy at the end. Other
modes (sampling, coupled sampling, trees, ``min_prob``) draw each token on the host from the
row as :class:`HFDrafter` does, on the same pooled forwards. On a CPU the same buckets run
eagerly, so CPU tests exercise this very layout (``tests/test_pooled_drafter.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from shared.engines.drafter import Draft, align_vocab
from shared.engines.target import ForwardItem
from shared.engines.transformers.drafter import HFDrafter
from shared.engines.transformers.graphs import StaticForwards
from shared.engines.transformers.kv_pool import KVPool, use_ragged_attention
from shared.engines.transformers.pooled import pooled_forward
from shared.protocol.sampling import SamplingConfig, greedy_tokens


class DrafterContextError(ValueError):
    """The drafted sequence outgrew the drafter's KV slot."""


class PooledDrafter(HFDrafter):
    """:class:`HFDrafter` on a KV slot with static one-token steps (see the module text).

    ``slot_tokens``: the longest sequence it drafts after (the verifier's context plus room to
    draft ahead); ``capture``: capture the buckets as CUDA graphs (default: on CUDA)."""

    def __init__(self, model: Any, vocab_size: int, slot_tokens: int,
                 capture: bool | None = None, **options: Any) -> None:
        super().__init__(model, vocab_size, **options)
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError("--cuda-graphs drafts with decoder-only models only")
        dtype = next(model.parameters()).dtype
        # Slot 0 holds the drafted sequence, slot 1 is the static buckets' padding scratch.
        self.pool = KVPool(model.config, 2, slot_tokens, dtype, self.device)
        self.context_tokens = slot_tokens
        slot = self.pool.allocate()
        assert slot is not None
        self.slot = slot
        use_ragged_attention(model)
        self.static = StaticForwards(model, self.pool, self.device, max_batch=1, capture=capture)
        self.static.warm()
        self.last_row: torch.Tensor | None = None  # [drafter vocab] after the last cached token

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.committed = list(prompt_ids)
        self.cached = []  # the slot is rewritten from position 0; nothing to free
        self.last_row = None

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Write ids into the slot after what is cached; the last one's logits row, on the
        device (a view of a bucket's output: valid until the next forward)."""
        start = len(self.cached)
        if start + len(ids) > self.pool.slot_tokens:
            raise DrafterContextError(
                f"the drafter's KV slot holds {self.pool.slot_tokens} tokens; this sequence "
                f"needs {start + len(ids)}")
        rows = pooled_forward(self.model, self.pool,
                              [ForwardItem(self.slot, start, ids, True,
                                           keep_from=len(ids) - 1)],
                              self.device, static=self.static)[0]
        assert rows is not None
        self.cached.extend(ids)
        self.last_row = rows[-1]
        return self.last_row

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        if ids:
            self._feed(ids)
        if self.last_row is None:  # nothing fed since the reset: as HFDrafter, an empty row
            return torch.empty(0)
        self.last_logits = align_vocab(self.last_row.float().cpu(), self.vocab_size)
        return self.last_logits  # [vocab]

    def _device_choice(self, row: torch.Tensor) -> torch.Tensor:
        """The argmax among the target's ids ([1], on the device): what ``_choose`` picks from
        the aligned host row (ids the target lacks are -inf there; padding is never chosen)."""
        return greedy_tokens(row[:self.vocab_size]).view(1)

    @torch.inference_mode()
    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        k = self._room(k)
        if (not config.greedy or self.tree_width > 1 or self.min_prob or k == 0
                or self.shaper is not None):
            return super().propose(k, config, generator)
        pending = self.committed[len(self.cached):]
        row = self._feed(pending) if pending else self.last_row
        if row is None:
            return super().propose(k, config, generator)
        tokens = [self._device_choice(row)]
        start = len(self.cached)
        for i in range(1, k):  # feed x_i, read x_{i+1}: no copy to the host in between
            stepped = self.static.step(self.slot, start + i - 1, tokens[-1])
            if stepped is None:
                raise DrafterContextError(
                    f"the drafter's KV slot holds {self.pool.slot_tokens} tokens")
            self.last_row = row = stepped[0]
            tokens.append(self._device_choice(row))
        ids = [int(t) for t in torch.cat(tokens).tolist()]  # the one copy back
        self.cached.extend(ids[:-1])
        return Draft(ids, None, None)

    def _roll_back(self, keep: int) -> None:
        """Nothing to erase: the next forward writes over the positions from ``keep`` on."""
        if keep < len(self.cached):
            self.last_row = None  # the logits after a position that is gone
