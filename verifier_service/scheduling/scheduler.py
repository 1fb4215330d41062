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
import os
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from shared.engines.target import NOTHING, Engine, EngineLost, Step, StepResult
from verifier_service.errors import VerifierError
from verifier_service.scheduling.load import RowCosts

log = logging.getLogger(__name__)
T = TypeVar("T")
ENGINE_LOST_EXIT = 3  # the verifier's exit status when its engine lost its model file


class Job(Protocol):
    kind: str  # "create" or "verify": the label of its latency metrics

    @property
    def num_tokens(self) -> int:
        """Tokens this job adds to a batched forward."""

    @property
    def session_key(self) -> Hashable | None:
        """The session it works on ((owner, id)); at most one job per session in a batch."""

    def prepare(self, busy: set[Any]) -> Step | None:
        """Validate and claim resources (model thread): what the engine should run for it, or
        None when nothing needs to run. ``busy``: sessions with a job in this batch, which must
        not be evicted."""

    def finish(self, result: StepResult) -> Any:
        """Turn the engine's result for its step (``NOTHING`` without one) into its answer
        (model thread)."""

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
    non_finite: int = 0  # calls failed because the engine's rows were not finite

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
            "non_finite_calls": self.non_finite,
        }


class BatchObserver(Protocol):
    def observe_batch(self, jobs: list[tuple[str, float]], tokens: int, started: float,
                      ended: float) -> None:
        """One batch ran: its jobs as (kind, queued_at), perf_counter times."""


class Scheduler:
    def __init__(self, engine: Engine, run_on_model_thread: Any, max_batch_size: int,
                 max_batch_tokens: int, batch_wait_ms: float, max_queue: int,
                 observer: BatchObserver | None = None,
                 row_costs: RowCosts | None = None) -> None:
        self.engine, self.run, self.observer = engine, run_on_model_thread, observer
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.batch_wait_s = batch_wait_ms / 1e3
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self.stats = SchedulerStats()
        self.row_costs = row_costs
        self._task: asyncio.Task[None] | None = None
        self._held: _Pending | None = None  # taken from the queue but over the batch's limits
        # A second call for a session already in the batch (a client's retry while its first
        # call is still queued) waits for the next batch, where it gets the first one's answer.
        self._deferred: list[_Pending] = []
        # session key -> when it last sent a job, within the last second (``_others_active``):
        # kept with batching only, the one reader, and pruned each batch, so it holds at most
        # a second's sessions (without batching it grew by every session ever seen)
        self._last_seen: dict[Hashable, float] = {}

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

    async def aside(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` on a worker thread, neither the event loop nor the model thread: a call's own
        work before it is queued (decoding its row masks)."""
        return await asyncio.to_thread(fn, *args)

    def forget(self, session_key: Hashable) -> None:
        """The session was closed: it will not send more jobs."""
        self._last_seen.pop(session_key, None)

    async def submit(self, job: Job) -> Any:
        pending = _Pending(job, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(pending)
        except asyncio.QueueFull:
            self.stats.rejected_full += 1
            raise VerifierError(429, "overloaded", f"the verifier's queue is full "
                                f"({self.queue.maxsize} jobs); retry later", None,
                                retry_after_s=1) from None
        if job.session_key is not None and self.max_batch_size > 1:  # a job refused is not seen
            self._last_seen[job.session_key] = time.perf_counter()
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
            outcomes = await self.run(run_jobs, self.engine, [p.job for p in batch],
                                      self.row_costs)
            ended = time.perf_counter()
            self.stats.forward_s += ended - started
            if self.observer is not None:
                self.observer.observe_batch([(p.job.kind, p.queued_at) for p in batch],
                                            sum(p.job.num_tokens for p in batch), started, ended)
            self.stats.batches += 1
            self.stats.jobs += len(batch)
            self.stats.batch_sizes[len(batch)] += 1
            codes = [getattr(value, "code", None) for ok, value in outcomes if ok is False]
            if "engine_non_finite" in codes:
                log.error("%d calls failed: the engine's rows were not finite",
                          codes.count("engine_non_finite"))
                self.stats.non_finite += codes.count("engine_non_finite")
            if "engine_lost" in codes:
                # the answers go out first; the exit code tells a supervisor to restart it
                asyncio.get_running_loop().call_later(0.5, os._exit, ENGINE_LOST_EXIT)
            for pending, (ok, value) in zip(batch, outcomes, strict=True):
                if pending.future.done():  # the caller went away
                    continue
                if ok is None:
                    self._deferred.append(pending)
                elif ok:
                    pending.future.set_result(value)
                else:
                    # Most often a session that is gone (evicted, expired, lost in a restart):
                    # no batch waits for it; its client's next job marks it active again.
                    self.forget(pending.job.session_key)
                    pending.future.set_exception(value)


def run_jobs(engine: Engine, jobs: list[Job], costs: RowCosts | None = None,
             ) -> list[tuple[bool | None, Any]]:
    """Model thread: prepare every job, one engine run for all, then finish each. Outcomes in
    job order: (True, answer), (False, exception) for a job that failed alone, or (None, None)
    for a second job of a session already in this batch (deferred to the next batch).
    ``costs``: learns from the forward and prices it in each result's ``load``."""
    outcomes: list[tuple[bool | None, Any] | None] = [None] * len(jobs)
    prepared: list[tuple[int, Step | None]] = []
    sessions: set[Any] = set()
    for i, job in enumerate(jobs):
        if job.session_key is not None and job.session_key in sessions:
            outcomes[i] = (None, None)  # one job per session per forward
            continue
        try:
            step = job.prepare(sessions)
        except VerifierError as exc:
            outcomes[i] = (False, exc)
            continue
        if job.session_key is not None:
            sessions.add(job.session_key)
        prepared.append((i, step))
    steps = [step for _, step in prepared if step is not None]
    try:
        started = time.perf_counter()
        ran = engine.run(steps) if steps else []
        if steps and costs is not None:  # each verdict says what its forward cost the batch
            seconds = time.perf_counter() - started
            costs.observe(steps, seconds)
            load = costs.load(steps, seconds)
            ran = [replace(result, load=load) for result in ran]
        results = iter(ran)
        answered = [(i, next(results) if step is not None else NOTHING) for i, step in prepared]
    except EngineLost as exc:  # nothing more can be served: answer, then end (``_loop``)
        log.critical("%s; the verifier ends (restart it to load the file again)", exc)
        lost = VerifierError(503, "engine_lost", f"{exc}; retry on another replica",
                             retry_after_s=1)
        for i, _ in prepared:
            jobs[i].abort()
            outcomes[i] = (False, lost)
        return [o for o in outcomes if o is not None]
    except Exception as exc:  # the forward failed: every prepared job fails with it
        log.exception("batched forward failed")
        for i, _ in prepared:
            jobs[i].abort()
            outcomes[i] = (False, exc)
        return [o for o in outcomes if o is not None]
    for i, result in answered:
        if result.non_finite:  # this call alone fails; its neighbours were decided
            jobs[i].abort()
            outcomes[i] = (False, VerifierError(
                500, "engine_non_finite",
                f"the {engine.info.engine or engine.info.dtype} engine's forward gave this "
                "call's rows NaN or infinite values; nothing was committed (retry, and report "
                "it if it repeats)"))
            continue
        try:
            outcomes[i] = (True, jobs[i].finish(result))
        except Exception as exc:  # noqa: BLE001 - reported to that job's caller only
            jobs[i].abort()
            outcomes[i] = (False, exc)
    return [o for o in outcomes if o is not None]
