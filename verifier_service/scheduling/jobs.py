"""The scheduler's jobs: validate against the session, claim a KV slot, answer from a verdict.

``prepare`` and ``finish`` run on the model thread, so sessions and KV slots change only there.
``prepare`` says what the engine should run (a :class:`Step`); ``finish`` turns the engine's
result into the response. A job sees only a :class:`JobContext` - the session table, the
validator, the engine's slots and the counters - never the app or the scheduler that runs it.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engines.target import Engine, ForwardItem, Step, StepResult
from shared.protocol.schema import (
    CreateSessionRequest,
    CreateSessionResponse,
    VerifyRequest,
    VerifyResponse,
)
from verifier_service.errors import VerifierError
from verifier_service.scheduling.sessions import Session, SessionKey, SessionStore, busy_error
from verifier_service.scheduling.validation import RequestValidator


@dataclass
class VerifyCounters:
    verify_calls: int = 0  # verify calls that ran a forward (advanced a session)
    replayed_calls: int = 0  # retried verify calls answered from the session's last reply
    scored_tokens: int = 0  # k + 1 per verify call that ran
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_tokens: int = 0
    drafts: int = 0  # verify calls that ran with at least one draft (vLLM's num_drafts)
    # accepted_at[i]: drafts whose token at 0-based position i was accepted (a tree's: the
    # i-th node of the accepted path)
    accepted_at: list[int] = field(default_factory=list)

    def count_block(self, drafted: int, accepted: int, positions: int) -> None:
        """A block of ``drafted`` tokens over ``positions`` positions (a chain's k, a tree's
        accepted depth) passed ``accepted``: each position is counted from its first block on,
        0 until a draft there passes, as vLLM reports one per speculative position."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if drafted:
            self.drafts += 1
        if positions > len(self.accepted_at):
            self.accepted_at.extend([0] * (positions - len(self.accepted_at)))
        for i in range(accepted):
            self.accepted_at[i] += 1


@dataclass
class JobContext:
    sessions: SessionStore
    validator: RequestValidator
    engine: Engine
    counters: VerifyCounters = field(default_factory=VerifyCounters)
    # plain runs in progress, by (owner, session, request digest), with the calls waiting for
    # their whole answer: the same call again while one runs (``generate.verify_call``)
    plain_runs: dict[tuple[str | None, str, str], list[asyncio.Future[Any]]] = field(
        default_factory=dict)

    def claim_slot(self, owner: str | None, busy: set[Any], own_only: bool = False) -> int:
        """A free KV slot; when none is left a session is evicted by the store's fair policy
        (its next call gets 404 and its client reopens it; ``own_only``: only the owner's
        own); 503 when none may go."""
        while (slot := self.engine.allocate()) is None:
            if not self.sessions.evict_one_for(owner, busy, own_only):
                raise busy_error("every KV slot holds a live client's session")
        return slot

    def hold(self, slot: int, tokens: int, owner: str | None, busy: set[Any],
             own_only: bool = False) -> None:
        """``slot`` holds ``tokens`` tokens; when its KV region must grow and the pool has no
        room, sessions are evicted by the store's fair policy (``own_only``: only the
        owner's own); 503 when none may go."""
        while not self.engine.reserve(slot, tokens):
            if tokens > self.engine.slot_tokens or not self.sessions.evict_one_for(
                    owner, busy, own_only):
                raise busy_error(f"the KV pool has no room for {tokens} tokens in a session")


def request_digest(req: CreateSessionRequest | VerifyRequest) -> str:
    return hashlib.sha256(req.model_dump_json().encode()).hexdigest()


@dataclass
class CreateSessionJob:
    """Prefill the prompt (all but its last token) into a fresh KV slot. Idempotent under a
    client-chosen id: the same create again, while the session is unused, gets the same answer."""

    ctx: JobContext
    req: CreateSessionRequest
    owner: str | None = None
    slot: int | None = None
    reserved: bool = False  # admitted against the key's session quota
    replay: Session | None = None  # a retried create of a session that exists unchanged
    started: float = field(default_factory=time.perf_counter)

    kind = "create"

    def __post_init__(self) -> None:
        self.digest = request_digest(self.req)
        self.session_id = self.req.session_id or secrets.token_urlsafe(12)  # client's, if any

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_ids) - 1

    @property
    def session_key(self) -> SessionKey:
        return (self.owner, self.session_id)

    def prepare(self, busy: set[Any]) -> Step | None:
        sessions = self.ctx.sessions
        existing = sessions.peek(self.session_id, self.owner)
        if existing is not None:
            if existing.create_digest == self.digest and existing.last_verify_position < 0:
                self.replay = existing  # the same create again (its answer was lost)
                return None
            raise VerifierError(409, "session_exists", f"session {self.session_id!r} already "
                                "exists; choose another id", "session_id")
        sessions.reserve(self.owner)  # 429 at the key's quota, creates in flight included
        self.reserved = True
        try:
            sessions.make_room(self.owner, busy)
            self.slot = self.ctx.claim_slot(self.owner, busy)
            self.ctx.hold(self.slot, len(self.req.prompt_ids), self.owner, busy)
        except VerifierError:
            self.abort()
            raise
        return self.step(self.slot)

    def step(self, slot: int) -> Step | None:
        """A decoder-only prompt waits in the session for its first verify, which writes it in
        the same forward as its block; an encoder-decoder session's source is encoded now."""
        if self.req.encoder_ids is None:
            return None
        return Step(ForwardItem(slot, 0, self.req.prompt_ids[:-1], keep_logits=False,
                                encoder_ids=self.req.encoder_ids))

    def finish(self, result: StepResult) -> CreateSessionResponse:
        if self.replay is not None:
            return CreateSessionResponse(session_id=self.replay.id,
                                         position=self.replay.position, prefill_ms=0.0)
        deferred = self.req.prompt_ids[:-1] if self.req.encoder_ids is None else []
        # a reopen: the original prompt less its last token was written as a prompt, the rest
        # as verify blocks
        length = self.req.prompt_length
        steps_from = length - 1 if length is not None and length < len(self.req.prompt_ids) \
            else None
        return self.open(len(self.req.prompt_ids), pending=deferred, steps_from=steps_from)

    def open(self, position: int, pending: list[int] | None = None,
             steps_from: int | None = None) -> CreateSessionResponse:
        """The session joins the table, its cache filled up to ``position`` once ``pending``
        is written."""
        assert self.slot is not None
        session = Session(slot=self.slot, position=position, config=self.req.sampling.to_config(),
                          id=self.session_id, owner=self.owner, create_digest=self.digest,
                          pending=list(pending or []), steps_from=steps_from)
        self.ctx.sessions.add(session)
        self.reserved = False
        self.ctx.counters.prefill_tokens += self.num_tokens
        return CreateSessionResponse(session_id=session.id, position=session.position,
                                     prefill_ms=1e3 * (time.perf_counter() - self.started))

    def abort(self) -> None:
        if self.reserved:
            self.ctx.sessions.unreserve(self.owner)
            self.reserved = False
        if self.slot is not None and not self.ctx.sessions.exists(self.session_id, self.owner):
            self.ctx.engine.release(self.slot)
            self.slot = None


@dataclass
class VerifyJob:
    """Score [last token, x_1..x_k] on top of the session's cache; keep the accepted prefix.
    Idempotent: the same call again (same position, same body) gets the same answer."""

    ctx: JobContext
    session_id: str
    req: VerifyRequest
    owner: str | None = None
    session: Session | None = None
    replay: VerifyResponse | None = None  # the answer to this very call, already given once
    started: float = field(default_factory=time.perf_counter)
    keep: torch.Tensor | None = None  # req.masks decoded on arrival (``verify_call``)

    kind = "verify"

    def __post_init__(self) -> None:
        self.digest = request_digest(self.req)

    @property
    def num_tokens(self) -> int:
        session = self.ctx.sessions.peek(self.session_id, self.owner)
        return len(self.req.draft_ids) + 1 + (len(session.pending) if session else 0)

    @property
    def session_key(self) -> SessionKey:
        return (self.owner, self.session_id)

    def prepare(self, busy: set[Any]) -> Step | None:
        self.session = session = self.ctx.sessions.get(self.session_id, self.owner)
        req = self.req
        if (req.position == session.last_verify_position
                and self.digest == session.last_verify_digest):
            self.replay = session.last_reply  # a retry: same answer, the cache moves once
            return None
        self.ctx.validator.check_verify(session, req)
        self.ctx.hold(session.slot, session.position + len(req.draft_ids), self.owner,
                      busy | {self.session_key})
        prefill = (ForwardItem(session.slot, 0, session.pending, keep_logits=False,
                               steps_from=session.steps_from) if session.pending else None)
        keep = self.keep
        if keep is None and req.masks is not None:  # not decoded on arrival
            keep = self.ctx.validator.decode_masks(req)
        block = req.block(session.config, keep)  # the request is its codec: read once, here
        return Step(
            ForwardItem(session.slot, session.position - 1, [req.last_token, *block.draft_ids],
                        keep_logits=True, tree_parents=block.tree_parents),
            block, prefill)

    def finish(self, result: StepResult) -> VerifyResponse:
        if self.replay is not None:
            self.ctx.counters.replayed_calls += 1
            return self.replay
        session, req, verdict = self.session, self.req, result.decided()
        assert session is not None
        session.pending, session.steps_from = [], None  # the forward wrote the deferred prompt
        # The slot holds position + k tokens now (a tree's accepted path already where a chain
        # would have put it); the session keeps the last token and the accepted drafts.
        session.position += verdict.num_accepted + 1
        counters = self.ctx.counters
        counters.verify_calls += 1
        counters.scored_tokens += len(req.draft_ids) + 1
        counters.count_block(len(req.draft_ids), verdict.num_accepted,
                             len(req.draft_ids) if req.tree_parents is None
                             else verdict.num_accepted)
        reply = VerifyResponse.of(verdict, session.position,
                                  1e3 * (time.perf_counter() - self.started), result.load)
        session.last_verify_position, session.last_verify_digest = req.position, self.digest
        session.last_reply = reply
        return reply

    def abort(self) -> None:
        pass  # the session's position did not move; whatever the slot got past it is ignored
