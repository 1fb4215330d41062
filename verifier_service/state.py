"""What a running verifier holds (built in the lifespan, kept on ``app.state.verifier``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from shared.engines.target import Engine
from shared.protocol.schema import PROTOCOL_VERSION, InfoResponse
from verifier_service.scheduling.jobs import JobContext
from verifier_service.scheduling.scheduler import Scheduler
from verifier_service.settings import Settings

T = TypeVar("T")


class ModelThread:
    """Runs model work on one dedicated thread, off the event loop, one call at a time.

    All of a process's model work - loading, warm-up and every forward - belongs on this one
    thread. Each thread that runs a parallel torch op gets its own OpenMP thread team, and while
    two teams live in one process every forward is slower (``python -m scripts.bench profile``;
    figures in ``docs/benchmarks.md``)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``run`` for code outside an event loop (the CLI's load before serving): blocks."""
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def describe(engine: Engine, settings: Settings) -> InfoResponse:
    """``GET /v1/info``: what a client must know before its first call."""
    info = engine.info
    return InfoResponse(
        protocol_version=PROTOCOL_VERSION, model=info.name, vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.fingerprint, eos_token_ids=info.eos_token_ids,
        max_context=info.max_context, max_draft_tokens=settings.max_draft_tokens,
        max_new_tokens=settings.max_new_tokens, dtype=info.dtype, device=info.device,
        is_encoder_decoder=info.encoder_decoder,
        decoder_start_token_id=info.decoder_start_token_id,
        verify_ms=[(k, ms) for k, ms in info.verify_ms if k <= settings.max_draft_tokens]
        or None, kernels=info.kernels, engine=info.engine or None,
        engine_choice=info.engine_choice or None,
    )


@dataclass
class VerifierState:
    settings: Settings
    engine: Engine
    jobs: JobContext  # session table, validator, the engine's slots, counters
    scheduler: Scheduler
    model_thread: ModelThread

    def info(self) -> InfoResponse:
        return describe(self.engine, self.settings)

    def metrics(self) -> dict[str, Any]:
        engine, sessions, counters = self.engine, self.jobs.sessions, self.jobs.counters
        return {
            "batching": self.settings.batching, **self.scheduler.stats.to_dict(),
            "queued": self.scheduler.queue.qsize(), "sessions": len(sessions),
            "evicted_sessions": sessions.evicted, "expired_sessions": sessions.expired,
            "kv_slots": engine.num_slots, "kv_slots_free": engine.free_slots,
            "kv_slot_tokens": engine.slot_tokens, "kv_pool_bytes": engine.nbytes,
            "verify_calls": counters.verify_calls, "replayed_calls": counters.replayed_calls,
            "scored_tokens": counters.scored_tokens, "drafted_tokens": counters.drafted_tokens,
            "accepted_tokens": counters.accepted_tokens,
            "acceptance_rate": round(counters.accepted_tokens / counters.drafted_tokens, 4)
            if counters.drafted_tokens else 0.0,
            "prefill_tokens": counters.prefill_tokens, "drafts": counters.drafts,
            "accepted_at": list(counters.accepted_at), "model": engine.info.name,
            "static_forwards": 0, "static_fallbacks": 0, "kv_region_moves": 0,
            **engine.counters(),
        }
