"""The verifier without HTTP: its jobs, validation, KV slot pool and sampling called directly.

For tests that need many thousands of generations (the statistical tests): the client's whole
loop and the verifier's whole request path after parsing run as in production, and every
request and reply still goes through its JSON form (the wire codec: -inf as null, base64 rows),
but no socket, event loop or thread hand-off is paid. The HTTP path itself is tested elsewhere
(every other end-to-end test). Clients on several threads can share one verifier through a
:class:`CallGroup`: their calls then run together, one batched forward per round, as the
scheduler batches concurrent clients.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

from pydantic import BaseModel

from drafter_client.transport import VerifierHTTPError
from shared.engines.target import Engine
from shared.protocol.schema import (
    CreateSessionRequest,
    CreateSessionResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
)
from verifier_service.errors import VerifierError
from verifier_service.lifespan import build_jobs
from verifier_service.scheduling.generate import verify_call
from verifier_service.scheduling.jobs import CreateSessionJob
from verifier_service.scheduling.scheduler import Job, run_jobs
from verifier_service.settings import Settings, load_engine
from verifier_service.state import describe

M = TypeVar("M", bound=BaseModel)


def _over_the_wire(message: BaseModel, model: type[M]) -> M:
    return model.model_validate_json(message.model_dump_json())


def _as_client_error(exc: BaseException) -> BaseException:
    """What the HTTP client would raise for the verifier's error."""
    if isinstance(exc, VerifierError):
        return VerifierHTTPError(exc.status, exc.code, exc.message, exc.field, exc.position)
    return exc


class CallGroup:
    """The calls of ``members`` client threads, run together: a call waits until every member
    that is still generating has one waiting, and the last to arrive runs them all as one
    ``run_jobs`` batch (the scheduler's own step). Which calls share a batch does not depend on
    timing, only on how many members there are."""

    def __init__(self, engine: Engine, members: int) -> None:
        self.engine, self.members = engine, members
        self._cond = threading.Condition()
        self._waiting: list[list[Any]] = []  # [job, outcome or None]

    def run(self, job: Job) -> tuple[bool | None, Any]:
        with self._cond:
            entry: list[Any] = [job, None]
            self._waiting.append(entry)
            self._flush_if_complete()
            while entry[1] is None:
                self._cond.wait()
            return entry[1]  # type: ignore[no-any-return]

    def leave(self) -> None:
        """A member is done: the others no longer wait for it."""
        with self._cond:
            self.members -= 1
            self._flush_if_complete()

    def _flush_if_complete(self) -> None:  # under the lock
        if not self._waiting or len(self._waiting) < self.members:
            return
        batch, self._waiting = self._waiting, []
        outcomes = run_jobs(self.engine, [job for job, _ in batch])
        for entry, outcome in zip(batch, outcomes, strict=True):
            entry[1] = outcome
        self._cond.notify_all()


def _run_now(coroutine: Any) -> Any:
    """The result of a coroutine that never waits (every await in it returns at once)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine waited for something")


class _HereScheduler:
    """What ``verify_call`` needs from the scheduler, on this thread: each job as a batch of
    one (or of its ``CallGroup``), functions called directly."""

    def __init__(self, verifier: InProcessVerifier) -> None:
        self.verifier = verifier

    async def submit(self, job: Job) -> Any:
        ok, value = self.verifier._outcome(job)
        if not ok:
            raise value
        return value

    async def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def aside(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


class InProcessVerifier:
    """Implements the client's ``Verifier`` protocol on an :class:`Engine` in this
    process. Each call runs as a batch of one job (``run_jobs``, the scheduler's own step)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings = engine, settings
        self.jobs = build_jobs(engine, settings)
        self.bytes_sent = self.bytes_received = self.retries = 0
        self.simulated_rtt_s = 0.0
        self.group: CallGroup | None = None  # set while clients on several threads share it

    @classmethod
    def load(cls, settings: Settings) -> InProcessVerifier:
        """Load ``settings.model`` as the verifier's lifespan would."""
        return cls(load_engine(settings), settings)

    def _run(self, job: Job, reply_model: type[M]) -> M:
        ok, value = self._outcome(job)
        if not ok:
            raise _as_client_error(value)
        return _over_the_wire(value, reply_model)

    def _outcome(self, job: Job) -> tuple[bool | None, Any]:
        if self.group is not None:
            return self.group.run(job)
        [outcome] = run_jobs(self.engine, [job])
        return outcome

    def info(self, budget_s: float | None = None) -> InfoResponse:
        return describe(self.engine, self.settings)

    def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse:
        req = _over_the_wire(req, CreateSessionRequest)
        try:
            self.jobs.validator.check_create(req.protocol_version, req.prompt_ids,
                                             req.encoder_ids)
        except VerifierError as exc:
            raise _as_client_error(exc) from None
        return self._run(CreateSessionJob(self.jobs, req), CreateSessionResponse)

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResponse:
        """The route's own ``verify_call`` (a plain run's steps included), its jobs run here."""
        req = _over_the_wire(req, VerifyRequest)
        try:
            reply = _run_now(verify_call(self.jobs, _HereScheduler(self), session_id, req,
                                         self.engine.info.eos_token_ids))
        except VerifierError as exc:
            raise _as_client_error(exc) from None
        return _over_the_wire(reply, VerifyResponse)

    def delete_session(self, session_id: str, budget_s: float = 2.0) -> None:
        self.jobs.sessions.discard(session_id)

    def generate(self, req: GenerateRequest) -> GenerateResponse:
        raise NotImplementedError("the target-alone loop is tested over HTTP")

    def close(self) -> None:
        pass
