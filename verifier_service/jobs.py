"""The scheduler's jobs: validate against the session, claim a KV slot, answer from the logits.

``prepare`` and ``finish`` run on the model thread, so sessions and KV slots change only there.
A job sees only a :class:`JobContext` - the session table, the validator, the KV pool and the
counters - never the app or the scheduler that runs it.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engine import ForwardItem
from shared.kv_pool import KVPool
from shared.sampling import (
    BlockVerdict,
    TreeVerdict,
    chosen_tree_verdict,
    chosen_verdict,
    verify_block,
    verify_tree,
)
from shared.schema import (
    CreateSessionRequest,
    CreateSessionResponse,
    EncodedRow,
    VerifyRequest,
    VerifyResponse,
    encode_logprobs,
)
from verifier_service.acceptance import AcceptTask, Decision, top_ids
from verifier_service.errors import VerifierError
from verifier_service.seq2seq import Seq2SeqPool
from verifier_service.sessions import Session, SessionKey, SessionStore, busy_error
from verifier_service.validation import RequestValidator


@dataclass
class VerifyCounters:
    verify_calls: int = 0  # verify calls that ran a forward (advanced a session)
    replayed_calls: int = 0  # retried verify calls answered from the session's last reply
    scored_tokens: int = 0  # k + 1 per verify call that ran
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_tokens: int = 0


@dataclass
class JobContext:
    sessions: SessionStore
    validator: RequestValidator
    pool: KVPool | Seq2SeqPool
    counters: VerifyCounters = field(default_factory=VerifyCounters)

    def claim_slot(self, owner: str | None, busy: set[Any]) -> int:
        """A free KV slot; when none is left a session is evicted by the store's fair policy
        (its next call gets 404 and its client reopens it); 503 when none may go."""
        while (slot := self.pool.allocate()) is None:
            if not self.sessions.evict_one_for(owner, busy):
                raise busy_error("every KV slot holds a live client's session")
        return slot


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
    # Target-only decoding (/v1/generate): prefill the whole prompt and draw the first token
    # from its last row with this uniform, as generate() does, instead of leaving the last
    # prompt token to the first step (one forward fewer per generation).
    first_uniform: float | None = None
    first_token: int | None = None

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

    def prepare(self, busy: set[Any]) -> ForwardItem | None:
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
        except VerifierError:
            self.abort()
            raise
        if self.first_uniform is not None:
            ids = self.req.prompt_ids
            return ForwardItem(self.slot, 0, ids, keep_logits=True, keep_from=len(ids) - 1)
        return ForwardItem(self.slot, 0, self.req.prompt_ids[:-1], keep_logits=False,
                           encoder_ids=self.req.encoder_ids)

    def accept_task(self) -> AcceptTask | None:
        """The first token of target-only decoding, drawn on the device (not for coupled
        sampling, whose noise is drawn on the host)."""
        config = self.req.sampling.to_config()
        if self.replay is not None or self.first_uniform is None or config.coupled:
            return None
        return AcceptTask([], None, [], self.first_uniform, config)

    def finish(self, logits: torch.Tensor | None,
               decision: Decision | None = None) -> CreateSessionResponse:
        if self.replay is not None:
            return CreateSessionResponse(session_id=self.replay.id,
                                         position=self.replay.position, prefill_ms=0.0)
        assert self.slot is not None
        position = len(self.req.prompt_ids)
        config = self.req.sampling.to_config()
        if self.first_uniform is not None:  # the prompt's last row: the first token
            no_drafts = torch.empty(0, dtype=torch.long)
            if decision is not None:
                verdict = (chosen_verdict(no_drafts, decision.argmax)
                           if decision.argmax is not None else decision.verdict)
            else:
                assert logits is not None  # [1, vocab]
                verdict = verify_block(logits, no_drafts, None,
                                       torch.empty(0, dtype=torch.float64), self.first_uniform,
                                       config, position)
            assert verdict is not None
            self.first_token = verdict.next_token
            position += 1  # the cache holds the prompt; the first token is committed
        session = Session(slot=self.slot, position=position, config=config,
                          id=self.session_id, owner=self.owner, create_digest=self.digest)
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
            self.ctx.pool.release(self.slot)
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

    kind = "verify"

    def __post_init__(self) -> None:
        self.digest = request_digest(self.req)

    @property
    def num_tokens(self) -> int:
        return len(self.req.draft_ids) + 1

    @property
    def session_key(self) -> SessionKey:
        return (self.owner, self.session_id)

    def prepare(self, busy: set[Any]) -> ForwardItem | None:
        self.session = session = self.ctx.sessions.get(self.session_id, self.owner)
        if (self.req.position == session.last_verify_position
                and self.digest == session.last_verify_digest):
            self.replay = session.last_reply  # a retry: same answer, the cache moves once
            return None
        self.ctx.validator.check_verify(session, self.req)
        return ForwardItem(session.slot, session.position - 1,
                           [self.req.last_token, *self.req.draft_ids], keep_logits=True,
                           tree_parents=self.req.tree_parents)

    def accept_task(self) -> AcceptTask | None:
        """Chains in greedy or plain sampling mode, and greedy trees, are decided on the
        device; coupled sampling and sampled trees take the host path."""
        session, req = self.session, self.req
        if self.replay is not None or session is None or session.config.coupled:
            return None
        if req.tree_parents is not None and not session.config.greedy:
            return None
        return AcceptTask(req.draft_ids, req.draft_logprobs, req.log_uniforms,
                          req.final_uniform, session.config, req.return_top_ids)

    def finish(self, logits: torch.Tensor | None,
               decision: Decision | None = None) -> VerifyResponse:
        if self.replay is not None:
            self.ctx.counters.replayed_calls += 1
            return self.replay
        session, req = self.session, self.req
        assert session is not None
        if decision is not None:
            top_ids = decision.top_ids
        else:
            assert logits is not None  # [k + 1, vocab]
            top_ids = self._top_ids(logits)
        if req.tree_parents is not None:
            reply = self._finish_tree(session, req, self._tree_verdict(logits, decision),
                                      top_ids)
        else:
            reply = self._finish_chain(session, req, self._chain_verdict(logits, decision),
                                       top_ids)
        session.last_verify_position, session.last_verify_digest = req.position, self.digest
        session.last_reply = reply
        return reply

    def _count(self, scored: int, accepted: int) -> None:
        counters = self.ctx.counters
        counters.verify_calls += 1
        counters.scored_tokens += scored + 1
        counters.drafted_tokens += scored
        counters.accepted_tokens += accepted

    def _top_ids(self, logits: torch.Tensor) -> list[list[int]] | None:
        n = self.req.return_top_ids
        return top_ids(logits, n) if n else None

    def _tree_verdict(self, logits: torch.Tensor | None,
                      decision: Decision | None) -> TreeVerdict:
        req, session = self.req, self.session
        assert session is not None and req.tree_parents is not None
        if decision is not None:
            assert decision.argmax is not None  # only greedy trees are decided on the device
            return chosen_tree_verdict(req.tree_parents, req.draft_ids, decision.argmax)
        assert logits is not None
        return verify_tree(logits, req.draft_ids, req.tree_parents, req.log_uniforms,
                           req.final_uniform, session.config, req.position)

    def _chain_verdict(self, logits: torch.Tensor | None,
                       decision: Decision | None) -> BlockVerdict:
        req, session = self.req, self.session
        assert session is not None
        draft_ids = torch.tensor(req.draft_ids, dtype=torch.long)
        if decision is not None:
            if decision.argmax is not None:
                return chosen_verdict(draft_ids, decision.argmax)
            assert decision.verdict is not None
            return decision.verdict
        assert logits is not None
        draft_lp = (torch.tensor(req.draft_logprobs, dtype=torch.float64)
                    if req.draft_logprobs is not None else None)
        return verify_block(logits, draft_ids, draft_lp,
                            torch.tensor(req.log_uniforms, dtype=torch.float64),
                            req.final_uniform, session.config, req.position)

    def _finish_tree(self, session: Session, req: VerifyRequest, verdict: TreeVerdict,
                     top_ids: list[list[int]] | None) -> VerifyResponse:
        # The slot holds the root at position - 1 and node i at position + i; the accepted path
        # moves to position, position + 1, ... where a chain would have put it.
        start = session.position
        assert isinstance(self.ctx.pool, KVPool)  # trees are refused for encoder-decoder targets
        self.ctx.pool.compact(session.slot, [start + node for node in verdict.path],
                              list(range(start, start + len(verdict.path))))
        session.position += len(verdict.path) + 1
        self._count(len(req.draft_ids), len(verdict.path))
        return VerifyResponse(
            num_accepted=len(verdict.path),
            target_logprobs=(encode_logprobs(verdict.target_logprobs)
                             if verdict.target_logprobs is not None else None),
            target_argmax=(verdict.target_argmax.tolist()
                           if verdict.target_argmax is not None else None),
            next_token=verdict.next_token, row=None, position=session.position,
            forward_ms=1e3 * (time.perf_counter() - self.started),
            top_ids=top_ids, accepted_path=verdict.path)

    def _finish_chain(self, session: Session, req: VerifyRequest, verdict: BlockVerdict,
                      top_ids: list[list[int]] | None) -> VerifyResponse:
        # The slot holds position + k tokens now; the session keeps last token + accepted.
        session.position += verdict.num_accepted + 1
        self._count(len(req.draft_ids), verdict.num_accepted)
        return VerifyResponse(
            num_accepted=verdict.num_accepted,
            target_logprobs=(encode_logprobs(verdict.target_logprobs)
                             if verdict.target_logprobs is not None else None),
            target_argmax=(verdict.target_argmax.tolist()
                           if verdict.target_argmax is not None else None),
            next_token=verdict.next_token,
            row=EncodedRow.encode(verdict.row) if verdict.row is not None else None,
            position=session.position,
            forward_ms=1e3 * (time.perf_counter() - self.started),
            top_ids=top_ids,
        )

    def abort(self) -> None:
        pass  # the session's position did not move; whatever the slot got past it is ignored
