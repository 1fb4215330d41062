"""The verifier's lifespan: load the target, build the session table, scheduler and sweeper;
tear them down on shutdown. Nothing exists before it runs (no state at import time)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from fastapi import FastAPI

from shared.engines.target import Engine
from verifier_service.scheduling.jobs import JobContext
from verifier_service.scheduling.load import RowCosts
from verifier_service.scheduling.scheduler import BatchObserver, Scheduler
from verifier_service.scheduling.sessions import SessionStore
from verifier_service.scheduling.validation import RequestValidator
from verifier_service.settings import Settings, check_against_model, load_engine
from verifier_service.state import ModelThread, VerifierState

log = logging.getLogger(__name__)


def build_jobs(engine: Engine, settings: Settings) -> JobContext:
    sessions = SessionStore(settings.max_sessions, settings.session_ttl_s,
                            on_drop=lambda s: engine.release(s.slot),
                            max_per_owner=settings.max_sessions_per_key,
                            protect_s=settings.session_protect_s)
    info = engine.info
    validator = RequestValidator(
        vocab_size=info.vocab_size, max_context=info.max_context,
        max_prompt=settings.max_prompt_tokens or info.max_context - 1,
        max_draft_tokens=settings.max_draft_tokens, max_new_tokens=settings.max_new_tokens,
        encoder_decoder=info.encoder_decoder, trees=engine.trees)
    return JobContext(sessions, validator, engine)


def make_lifespan(settings: Settings, engine: Engine | None = None,
                  observer: BatchObserver | None = None,
                  model_thread: ModelThread | None = None) -> Callable[[FastAPI], Any]:
    """``engine``: a loaded target to serve (tests share one between apps); else it is loaded
    from ``settings.model`` on the model thread. ``observer``: sees every batch (metrics).
    ``model_thread``: the thread that loaded ``engine`` (the CLI's), so that one thread runs
    all of its forwards; else a new one."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        thread = model_thread or ModelThread()
        target = engine
        if target is None:
            target = await thread.run(load_engine, settings)
        check_against_model(settings, target.info.max_context, target.info.model_limit)
        scheduler = Scheduler(
            target, thread.run,
            max_batch_size=settings.max_batch_size if settings.batching else 1,
            max_batch_tokens=settings.max_batch_tokens,
            batch_wait_ms=settings.batch_wait_ms if settings.batching else 0.0,
            max_queue=settings.max_queue, observer=observer,
            row_costs=RowCosts(target.info.verify_ms),
        )
        state = VerifierState(settings, target, build_jobs(target, settings), scheduler,
                              thread)
        scheduler.start()
        app.state.verifier = state
        sweeper = asyncio.create_task(_expire_sessions(state))
        try:
            yield
        finally:
            sweeper.cancel()
            await scheduler.stop()
            thread.shutdown()

    return lifespan


async def _expire_sessions(state: VerifierState, every_s: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        dropped = await state.model_thread.run(state.jobs.sessions.expire_idle)
        if dropped:
            log.info("expired %d idle sessions", dropped)
