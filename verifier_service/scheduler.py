"""Batches concurrent jobs (prefills and verify blocks of many sessions) into one forward pass.

Jobs wait in a bounded queue. The batching loop takes the first job, then keeps taking jobs that
are already queued or arrive within ``batch_wait_ms``, up to ``max_batch_size`` jobs and
``max_batch_tokens`` tokens, and runs them as one ragged forward on the model thread. It waits
only while a session that sent a job in the last second is missing from the batch, so a lone
client never waits and a full set of clients is not kept waiting either.
While a forward runs, new jobs queue up, so under load batches form by themselves. Each job
validates itself against its session on the model thread, so a bad job fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shared.engine import ForwardItem
from verifier_service.acceptance import AcceptTask, Decision, decide
from verifier_service.errors import VerifierError
from verifier_service.target import TargetRunner, host_rows

log = logging.getLogger(__name__)


class Job(Protocol):
    kind: str  # "create" or "verify": the label of its latency metrics

    @property
    def num_tokens(self) -> int:
        """Tokens this job adds to a batched forward."""

    @property
    def session_key(self) -> Hashable | None:
        """The session it works on ((owner, id)); at most one job per session in a batch."""

    def prepare(self, busy: set[Any]) -> ForwardItem | None:
        """Validate and claim resources (model thread); None when nothing needs a forward.
        ``busy``: sessions with a job in this batch, which must not be evicted."""

    def accept_task(self) -> AcceptTask | None:
        """After ``prepare``: what the batched device acceptance should decide for this job, or
        None to get its logits rows on the host instead."""

    def finish(self, logits: torch.Tensor | None, decision: Decision | None = None) -> Any:
        """Turn the job's logits rows ([n, vocab] float32, on the host) or the device's
        decision into its answer (model thread)."""

    def abort(self) -> None:
        """Undo ``prepare`` after a failed forward."""


@dataclass
class _Pending:
    job: Job
    future: asyncio.Future[Any]
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass
class SchedulerStats:
    batches: int = 0
    jobs: int = 0
    forward_s: float = 0.0
    queue_wait_s: float = 0.0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    rejected_full: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches, "jobs": self.jobs,
            "mean_batch_size": round(self.jobs / self.batches, 3) if self.batches else 0.0,
            "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "mean_forward_ms": round(1e3 * self.forward_s / self.batches, 3)
            if self.batches else 0.0,
            "mean_queue_wait_ms": round(1e3 * self.queue_wait_s / self.jobs, 3)
            if self.jobs else 0.0,
            "rejected_queue_full": self.rejected_full,
        }


class BatchObserver(Protocol):
    def observe_batch(self, jobs: list[tuple[str, float]], tokens: int, started: float,
                      ended: float) -> None:
        """One batch ran: its jobs as (kind, queued_at), perf_counter times."""


class Scheduler:
    def __init__(self, runner: TargetRunner, run_on_model_thread: Any, max_batch_size: int,
                 max_batch_tokens: int, batch_wait_ms: float, max_queue: int,
                 observer: BatchObserver | None = None) -> None:
        self.runner, self.run, self.observer = runner, run_on_model_thread, observer
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.batch_wait_s = batch_wait_ms / 1e3
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self.stats = SchedulerStats()
        self._task: asyncio.Task[None] | None = None
        self._held: _Pending | None = None  # taken from the queue but over the batch's limits
        # A second call for a session already in the batch (a client's retry while its first
        # call is still queued) waits for the next batch, where it gets the first one's answer.
        self._deferred: list[_Pending] = []
        self._last_seen: dict[Hashable, float] = {}  # session key -> when it last sent a job

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _others_active(self, batch: list[_Pending]) -> bool:
        """Did a session outside this batch send a job in the last second?"""
        horizon = time.perf_counter() - 1.0
        mine = {p.job.session_key for p in batch}
        stale = [sid for sid, at in self._last_seen.items() if at < horizon]
        for sid in stale:
            del self._last_seen[sid]
        return any(sid not in mine for sid in self._last_seen)

    def forget(self, session_key: Hashable) -> None:
        """The session was closed: it will not send more jobs."""
        self._last_seen.pop(session_key, None)

    async def submit(self, job: Job) -> Any:
        if job.session_key is not None:
            self._last_seen[job.session_key] = time.perf_counter()
        pending = _Pending(job, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(pending)
        except asyncio.QueueFull:
            self.stats.rejected_full += 1
            raise VerifierError(429, "overloaded", f"the verifier's queue is full "
                                f"({self.queue.maxsize} jobs); retry later", None,
                                retry_after_s=1) from None
        return await pending.future

    async def _next_batch(self) -> list[_Pending]:
        if self._held is not None:
            first, self._held = self._held, None
        elif self._deferred:
            first = self._deferred.pop(0)
        else:
            first = await self.queue.get()
        batch, tokens = [first], first.job.num_tokens
        deadline = time.perf_counter() + self.batch_wait_s
        while len(batch) < self.max_batch_size:
            left = deadline - time.perf_counter() if self._others_active(batch) else 0.0
            try:
                pending = (self.queue.get_nowait() if left <= 0
                           else await asyncio.wait_for(self.queue.get(), left))
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            if tokens + pending.job.num_tokens > self.max_batch_tokens:
                self._held = pending  # first in the next batch
                break
            batch.append(pending)
            tokens += pending.job.num_tokens
        return batch

    async def _loop(self) -> None:
        while True:
            batch = await self._next_batch()
            started = time.perf_counter()
            for pending in batch:
                self.stats.queue_wait_s += started - pending.queued_at
            outcomes = await self.run(run_jobs, self.runner, [p.job for p in batch])
            ended = time.perf_counter()
            self.stats.forward_s += ended - started
            if self.observer is not None:
                self.observer.observe_batch([(p.job.kind, p.queued_at) for p in batch],
                                            sum(p.job.num_tokens for p in batch), started, ended)
            self.stats.batches += 1
            self.stats.jobs += len(batch)
            self.stats.batch_sizes[len(batch)] += 1
            for pending, (ok, value) in zip(batch, outcomes, strict=True):
                if pending.future.done():  # the caller went away
                    continue
                if ok is None:
                    self._deferred.append(pending)
                elif ok:
                    pending.future.set_result(value)
                else:
                    pending.future.set_exception(value)


class Forward(Protocol):
    acceptance: str  # "device": jobs with an accept task are decided by acceptance.decide

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor | None]:
        """One forward over every item's new tokens; a logits row block per item that asked."""


def needs_forward(item: ForwardItem) -> bool:
    """New tokens, or a new encoder-decoder session's encoder input."""
    return bool(item.token_ids) or item.encoder_ids is not None


def run_jobs(runner: Forward, jobs: list[Job]) -> list[tuple[bool | None, Any]]:
    """Model thread: prepare every job, one forward for all, then finish each. Outcomes in job
    order: (True, answer), (False, exception) for a job that failed alone, or (None, None) for a
    second job of a session already in this batch (deferred to the next batch)."""
    outcomes: list[tuple[bool | None, Any] | None] = [None] * len(jobs)
    prepared: list[tuple[int, ForwardItem | None]] = []
    sessions: set[Any] = set()
    for i, job in enumerate(jobs):
        if job.session_key is not None and job.session_key in sessions:
            outcomes[i] = (None, None)  # one job per session per forward
            continue
        try:
            item = job.prepare(sessions)
        except VerifierError as exc:
            outcomes[i] = (False, exc)
            continue
        if job.session_key is not None:
            sessions.add(job.session_key)
        prepared.append((i, item))
    items = [item for _, item in prepared if item is not None and needs_forward(item)]
    try:
        rows = iter(runner.forward(items) if items else [])
        scored = [(i, next(rows) if item is not None and needs_forward(item) else None)
                  for i, item in prepared]
        decisions = (decide_jobs(jobs, scored) if getattr(runner, "acceptance", "host")
                     == "device" else {})
    except Exception as exc:  # the forward failed: every prepared job fails with it
        log.exception("batched forward failed")
        for i, _ in prepared:
            jobs[i].abort()
            outcomes[i] = (False, exc)
        return [o for o in outcomes if o is not None]
    for i, logits in scored:
        decision = decisions.get(i)
        try:
            if decision is not None:
                outcomes[i] = (True, jobs[i].finish(None, decision))
            else:
                outcomes[i] = (True, jobs[i].finish(
                    None if logits is None else host_rows(logits)))
        except Exception as exc:  # noqa: BLE001 - reported to that job's caller only
            jobs[i].abort()
            outcomes[i] = (False, exc)
    return [o for o in outcomes if o is not None]


def decide_jobs(jobs: list[Job], scored: list[tuple[int, torch.Tensor | None]]
                ) -> dict[int, Decision]:
    """The device acceptance for every job of the batch that has a task, in one step."""
    picked: list[tuple[int, torch.Tensor, AcceptTask]] = []
    for i, logits in scored:
        task = jobs[i].accept_task() if logits is not None else None
        if task is not None and logits is not None:
            picked.append((i, logits, task))
    if not picked:
        return {}
    decided = decide([rows for _, rows, _ in picked], [task for _, _, task in picked])
    return {i: decision for (i, _, _), decision in zip(picked, decided, strict=True)}
