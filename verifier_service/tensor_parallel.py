"""Tensor parallelism: one target split over the ranks of a ``torchrun`` group.

transformers shards the model (``from_pretrained(tp_plan="auto")``: attention heads and MLP
columns per rank, collectives inside the forward), so every rank must run every forward, with the
same inputs, in the same order. Rank 0 is the verifier (HTTP, sessions, scheduler); before each
model operation it broadcasts what it is about to run, and the other ranks, in
:func:`follow`, run the same operation on their own shard and their own KV pool (which holds
their share of the KV heads). Only rank 0 listens on the port.

    torchrun --nproc-per-node 2 -m verifier_service.cli --model MODEL --tp-plan auto
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

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


def follow(runner: Any) -> None:
    """Ranks > 0: run what rank 0 announces until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, args = box[0]
        if op == "stop":
            log.info("rank %d: stop", dist.get_rank())
            return
        if op == "forward":
            runner.local_forward(*args)
        elif op == "reorder":
            runner.pool.local_reorder(*args)
        elif op == "compact":
            runner.pool.local_compact(*args)
        else:
            raise RuntimeError(f"unknown lockstep operation {op!r}")
