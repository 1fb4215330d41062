"""Static-shape forwards of short batches, replayed as CUDA graphs (``--cuda-graphs``).

An eager forward of a small model on a GPU is launch-bound: one kernel launch per op takes longer
than reading the weights. A CUDA graph replays a captured forward with one launch,
but only for fixed shapes and fixed buffers. Batches of short segments (verify blocks and decode
steps) are laid out so their shapes depend on a bucket alone:

* B segments (padded with segments that write into a reserved scratch slot), each padded to L
  tokens (the pad tokens write past the session's length, where nothing is read);
* attention over the first E positions of every slot (``kv_pool.PaddedGroup``), E one of
  ``E_STEP * 2**i`` up to the longest context (at most twice the positions a batch needs, and
  few enough buckets to capture them all);
* logits for all B * L rows, copied into one output buffer all buckets share (so a bucket holds
  no [B * L, vocab] tensor of its own); the kept ones are picked out afterwards.

Every input is copied into the bucket's static buffers, then the bucket runs: on CUDA its
captured graph (every bucket the settings can reach is captured by ``warm`` before the verifier
says ready, after two warm-up runs each on a side stream, all in one memory pool); elsewhere the
same function eagerly, so CPU tests run this very layout
(``tests/test_graphs.py``). A batch that fits no bucket (a prefill, a long block, a full slot)
takes the eager path.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

import torch

from shared.engines.transformers.kv_pool import (
    KEY_ALIGN,
    KVPool,
    PaddedGroup,
    RaggedBatch,
    chain_mask,
    key_positions,
)
from shared.protocol.transfer import Upload

log = logging.getLogger(__name__)
# A capture makes CUDA calls that other captures in the process must not interleave with (the
# gateway's worker threads each build a pooled drafter): one at a time.
CAPTURE_LOCK = threading.Lock()

B_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # segments per batch
L_BUCKETS = (1, 2, 3, 5, 9, 17)  # new tokens per segment: k + 1 for k in 0, 1, 2, 4, 8, 16
E_STEP = 256  # attended slot prefix: E_STEP * 2**i, the smallest that holds the batch


@dataclass(frozen=True)
class Shaped:
    """One segment of a batch as the static layout needs it."""

    slot: int
    start: int
    token_ids: list[int]
    positions: list[int]  # each token's position id
    visible: torch.Tensor | None  # [length, start + length] or None (sees all before it)
    keep_from: int | None  # rows kept from this index on; None: no logits wanted


class Bucket:
    """Static buffers for one (B, L, E), the forward over them, and its graph on CUDA."""

    def __init__(self, model: Any, pool: KVPool, scratch: int, b: int, length: int, end: int,
                 device: torch.device, capture: bool, graph_pool: Any,
                 output: torch.Tensor) -> None:
        """``output``: [rows >= B * L, vocab], shared by the buckets: each run writes its logits
        there (valid until the next run of any bucket)."""
        self.model, self.b, self.length, self.end = model, b, length, end
        self.output = output[:b * length]
        self.device = device
        self.pool = pool
        n = b * length
        self.ids = torch.zeros(1, n, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.long, device=device)
        self.write_index = torch.zeros(n, dtype=torch.long, device=device)
        self.bases = torch.zeros(b, dtype=torch.long, device=device)  # each segment's region
        self.gather = torch.zeros(b, end, dtype=torch.long, device=device)
        self.starts = torch.zeros(b, dtype=torch.long, device=device)
        self.lengths = torch.zeros(b, dtype=torch.long, device=device)  # 0: every row a pad
        self.allow = torch.ones(b, 1, length, end, dtype=torch.bool, device=device)  # trees
        self.tree_rows: list[int] = []  # segments whose ``allow`` rows a tree changed
        self.mask = torch.empty(b, 1, length, end, dtype=torch.bool, device=device)
        self._load_scratch(scratch)
        self.keep = torch.arange(n, device=device)
        flat = torch.arange(n, device=device)
        group = PaddedGroup(self.gather, flat.view(b, length), flat, flat, self.mask, end)
        self.batch = RaggedBatch(pool, self.write_index, [], group)
        self.graph: Any = None
        self.out: torch.Tensor | None = None
        if capture:
            self._capture(graph_pool)

    def _load_scratch(self, scratch: int) -> None:
        """Every segment a pad in the scratch slot (its tokens write there)."""
        base = self.pool.base(scratch)
        self.write_index.copy_(base + torch.arange(self.length, device=self.device).repeat(self.b))
        self.bases.fill_(base)

    def run(self) -> torch.Tensor:
        """[B * L, vocab] logits of the static inputs as they are now (the mask is computed
        from the starts and lengths inside it: a graph replays that too)."""
        self.mask.copy_(chain_mask(self.starts, self.lengths, self.length, self.end) & self.allow)
        self.gather.copy_(key_positions(self.bases, self.end, self.pool.regions.total))
        out = self.model(input_ids=self.ids, position_ids=self.positions, use_cache=False,
                         logits_to_keep=self.keep, ragged_batch=self.batch)
        self.output.copy_(out.logits[0])  # the logits themselves are freed (inside a graph:
        return self.output  # their memory is the pool's, for the next capture)

    def _capture(self, graph_pool: Any) -> None:
        """Two warm-up runs on a side stream, then the capture; on this bucket's device (not
        the current one: ``cuda:1`` stays on device 1), one capture at a time in the process
        (``CAPTURE_LOCK``), and in ``thread_local`` error mode so other threads' CUDA work - the
        gateway's other generations - neither fails nor spoils it."""
        with CAPTURE_LOCK, torch.cuda.device(self.device):
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: every write goes to the scratch slot
                for _ in range(2):
                    self.run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=graph_pool, capture_error_mode="thread_local"):
                self.out = self.run()

    def forward(self, shaped: list[Shaped], scratch: int) -> torch.Tensor:
        """Load the batch into the static buffers (one copy from the host) and run;
        [B * L, vocab] logits."""
        b, length, pool = self.b, self.length, self.pool
        ids = [0] * (b * length)
        positions = [0] * (b * length)
        scratch_base = pool.base(scratch)
        write = [scratch_base + i for _ in range(b) for i in range(length)]
        bases = [scratch_base] * b
        starts, lengths = [0] * b, [0] * b
        for i, seg in enumerate(shaped):
            n, at = len(seg.token_ids), i * length
            ids[at:at + n] = seg.token_ids
            positions[at:at + length] = seg.positions + [seg.positions[-1]] * (length - n)
            base = pool.base(seg.slot)  # pad tokens write past the session's end
            write[at:at + length] = range(base + seg.start, base + seg.start + length)
            bases[i], starts[i], lengths[i] = base, seg.start, n
        upload = Upload(self.device)
        parts = [upload.add(v) for v in (ids, positions, write, bases, starts, lengths)]
        upload.send()
        for buffer, part in zip((self.ids, self.positions, self.write_index, self.bases,
                                 self.starts, self.lengths), parts, strict=True):
            buffer.view(-1).copy_(upload.get(part))
        for i in self.tree_rows:  # the last batch's trees
            self.allow[i].fill_(True)
        self.tree_rows = [i for i, seg in enumerate(shaped) if seg.visible is not None]
        for i in self.tree_rows:
            visible = shaped[i].visible
            assert visible is not None
            self.allow[i, 0, :visible.shape[0], :visible.shape[1]] = visible.to(self.device)
        return self._replay()

    def step(self, slot: int, start: int, token: torch.Tensor) -> torch.Tensor:
        """B = L = 1: ``token`` (one id already on the device, e.g. the last step's argmax: it
        never goes through the host) at position ``start`` of ``slot``; [1, vocab] logits.
        Nothing is copied from the host."""
        assert self.b == 1 and self.length == 1
        self.ids.view(-1).copy_(token.view(-1))
        base = self.pool.base(slot)
        self.positions.fill_(start)
        self.starts.fill_(start)
        self.lengths.fill_(1)
        self.write_index.fill_(base + start)
        self.bases.fill_(base)
        return self._replay()

    def _replay(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            assert self.out is not None
            return self.out
        return self.run()


class StaticForwards:
    """The buckets of one runner; ``forward`` answers None when a batch fits none of them."""

    def __init__(self, model: Any, pool: KVPool, device: torch.device, max_batch: int,
                 capture: bool | None = None, max_length: int = L_BUCKETS[-1]) -> None:
        """``capture``: replay the buckets as CUDA graphs (default: on CUDA); ``max_length``:
        the longest segment to serve (k + 1 for the largest k)."""
        scratch = pool.allocate()
        if scratch is None:
            raise RuntimeError("--cuda-graphs needs one free KV slot for padding")
        self.model, self.pool, self.device = model, pool, device
        self.capture = device.type == "cuda" if capture is None else capture
        self.scratch = scratch
        self.b_buckets = tuple(b for b in B_BUCKETS if b < max_batch) + (
            min(max_batch, B_BUCKETS[-1]),)
        self.l_buckets = tuple(n for n in L_BUCKETS if n < max_length) + (
            min(max_length, L_BUCKETS[-1]),)
        longest = -(-pool.slot_tokens // KEY_ALIGN) * KEY_ALIGN  # the context, aligned
        self.ends = tuple(min(E_STEP << i, longest)
                          for i in range(max(longest // E_STEP, 1).bit_length()))
        if self.ends[-1] < longest:
            self.ends += (longest,)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.output = torch.empty(self.b_buckets[-1] * self.l_buckets[-1], vocab,
                                  dtype=next(model.parameters()).dtype, device=device)
        self.buckets: dict[tuple[int, int, int], Bucket] = {}
        self.graph_pool: Any = None
        if self.capture:
            with torch.cuda.device(device):
                self.graph_pool = torch.cuda.graph_pool_handle()
        self.replays = self.fallbacks = 0

    @torch.inference_mode()  # the forwards run under it; their buffers are made so
    def warm(self, lengths: tuple[int, ...] | None = None) -> None:
        """Build (on CUDA: capture) every bucket a batch can reach - each B, each L of
        ``lengths`` (default: all up to ``max_length``), each E - before the verifier says ready,
        so no batch waits for a capture while serving."""
        started = time.perf_counter()
        for b in self.b_buckets:
            for length in lengths or self.l_buckets:
                for end in self.ends:
                    if length <= end:
                        self.bucket((b, length, end))
        log.info("%d static forwards %s in %.1f s (B %s, L %s, E %s; shared output %.0f MiB)",
                 len(self.buckets), "captured" if self.capture else "built",
                 time.perf_counter() - started, self.b_buckets, lengths or self.l_buckets,
                 self.ends, self.output.numel() * self.output.element_size() / 2**20)

    def bucket(self, key: tuple[int, int, int]) -> Bucket:
        """The bucket for (B, L, E), built (on CUDA: captured) the first time."""
        found = self.buckets.get(key)
        if found is None:
            started = time.perf_counter()
            found = self.buckets[key] = Bucket(self.model, self.pool, self.scratch, *key,
                                               device=self.device, capture=self.capture,
                                               graph_pool=self.graph_pool, output=self.output)
            log.info("static forward B=%d L=%d E=%d %s in %.0f ms", *key,
                     "captured" if self.capture else "built", 1e3 * (time.perf_counter() - started))
        return found

    def bucket_of(self, shaped: list[Shaped]) -> tuple[int, int, int] | None:
        longest = max(len(s.token_ids) for s in shaped)
        i, j = bisect_left(self.b_buckets, len(shaped)), bisect_left(self.l_buckets, longest)
        if i == len(self.b_buckets) or j == len(self.l_buckets):
            return None
        length = self.l_buckets[j]
        if not all(self.pool.reserve(s.slot, s.start + length) for s in shaped):
            return None  # the pad tokens would run past the slot
        return self.b_buckets[i], length, self.end_of(max(s.start + len(s.token_ids)
                                                           for s in shaped))

    def end_of(self, seen: int) -> int:
        """E for a batch whose longest segment reaches position ``seen``: the smallest of
        ``ends`` that holds it."""
        return self.ends[min(bisect_left(self.ends, seen), len(self.ends) - 1)]

    def step(self, slot: int, start: int, token: torch.Tensor) -> torch.Tensor | None:
        """One token (a device tensor) at ``start`` of ``slot`` through the (1, 1, E) bucket:
        [1, vocab] logits (a view of the bucket's output, valid until its next run), or None
        when the slot is full."""
        if not self.pool.reserve(slot, start + 1):
            self.fallbacks += 1
            return None
        self.replays += 1
        return self.bucket((1, 1, self.end_of(start + 1))).step(slot, start, token)

    def forward(self, shaped: list[Shaped]) -> list[torch.Tensor | None] | None:
        """Each segment's kept logits rows ([n, vocab] views of the bucket's output, valid until
        the next forward), or None when the batch fits no bucket."""
        key = self.bucket_of(shaped) if shaped else None
        if key is None:
            self.fallbacks += 1
            return None
        self.replays += 1
        logits = self.bucket(key).forward(shaped, self.scratch)  # [B * L, vocab]
        length = key[1]
        return [None if seg.keep_from is None else
                logits[i * length + seg.keep_from:i * length + len(seg.token_ids)]
                for i, seg in enumerate(shaped)]
