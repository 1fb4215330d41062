"""Tensor parallelism: one target split over the ranks of a ``torchrun`` group.

transformers shards the model (``from_pretrained(tp_plan="auto")``: attention heads and MLP
columns per rank, collectives inside the forward), so every rank must run every forward, with the
same inputs, in the same order. Rank 0 is the verifier (HTTP, sessions, scheduler); before each
model operation (a forward, a tree's path kept, a beam reorder) it broadcasts what it is about
to run, and the other ranks, in :func:`follow`, run the same operation on their own shard and
their own KV pool (which holds their share of the KV heads). Only rank 0 listens on the port.
:class:`TensorParallel` is that, as a wrapper around the rank's engine.

    torchrun --nproc-per-node 2 -m verifier_service.cli --model MODEL --tp-plan auto
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from shared.engines.target import BatchForward, ForwardItem, PoolSlots

log = logging.getLogger(__name__)


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Lockstep:
    """Rank 0 announces each model operation to the other ranks (``broadcast_object_list``)."""

    def __init__(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def announce(self, op: str, *args: Any) -> None:
        if self.leader and self.world_size > 1:
            dist.broadcast_object_list([(op, args)], src=0)

    def stop(self) -> None:
        self.announce("stop")


class TensorParallel(PoolSlots, BatchForward):
    """An engine whose model operations every rank runs: rank 0 announces each one first."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner  # this rank's CausalEngine
        self.pool = inner.pool
        self.lockstep = Lockstep()
        self.info, self.trees, self.acceptance = inner.info, inner.trees, inner.acceptance

    @property
    def leader(self) -> bool:
        return self.lockstep.leader

    def counters(self) -> dict[str, int]:
        return self.inner.counters()  # type: ignore[no-any-return]

    # Every rank's pool hands out the same slots and regions: the same calls in the same order.
    def allocate(self) -> int | None:
        self.lockstep.announce("allocate")
        return self.inner.pool.allocate()  # type: ignore[no-any-return]

    def release(self, slot: int) -> None:
        self.lockstep.announce("release", slot)
        self.inner.pool.release(slot)

    def reserve(self, slot: int, tokens: int) -> bool:
        self.lockstep.announce("reserve", slot, tokens)
        return bool(self.inner.pool.reserve(slot, tokens))

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        self.lockstep.announce("forward", items)
        return self.inner.forward(items)  # type: ignore[no-any-return]

    def keep_path(self, slot: int, root: int, path: list[int]) -> None:
        self.lockstep.announce("keep_path", slot, root, path)
        self.inner.keep_path(slot, root, path)

    def reorder(self, slots: list[int], parents: list[int], length: int) -> None:
        self.lockstep.announce("reorder", slots, parents, length)
        self.inner.reorder(slots, parents, length)

    def stop(self) -> None:
        self.lockstep.stop()


def follow(engine: TensorParallel) -> None:
    """Ranks > 0: run what rank 0 announces until it says stop."""
    operations = {"forward": engine.inner.forward, "keep_path": engine.inner.keep_path,
                  "reorder": engine.inner.reorder, "allocate": engine.inner.pool.allocate,
                  "release": engine.inner.pool.release, "reserve": engine.inner.pool.reserve}
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, args = box[0]
        if op == "stop":
            log.info("rank %d: stop", dist.get_rank())
            return
        if op not in operations:
            raise RuntimeError(f"unknown lockstep operation {op!r}")
        operations[op](*args)
