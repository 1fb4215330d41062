"""The verifier's jobs: validate against the session, forward (batched by the scheduler), answer.

``prepare`` and ``finish`` run on the model thread, so sessions and KV slots change only there.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

import torch

from shared.sampling import draw_uniforms, verify_block
from shared.schema import (
    PROTOCOL_VERSION,
    CreateSessionRequest,
    CreateSessionResponse,
    EncodedRow,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    encode_logprobs,
)
from verifier_service.errors import VerifierError
from verifier_service.scheduler import Scheduler
from verifier_service.sessions import Session, SessionStore
from verifier_service.settings import Settings
from verifier_service.target import ForwardItem, TargetRunner


class VerifierService:
    def __init__(self, runner: TargetRunner, settings: Settings) -> None:
        self.runner, self.settings = runner, settings
        self.sessions = SessionStore(settings.max_sessions, settings.session_ttl_s,
                                     on_drop=lambda s: runner.pool.release(s.slot))
        self.max_context = runner.max_context
        self.max_prompt = settings.max_prompt_tokens or self.max_context - 1
        self.verify_calls = 0  # verify calls that ran a forward (advanced a session)
        self.replayed_calls = 0  # retried verify calls answered from the session's last reply

    def info(self) -> InfoResponse:
        r = self.runner
        return InfoResponse(
            protocol_version=PROTOCOL_VERSION, model=r.name, vocab_size=r.vocab_size,
            tokenizer_fingerprint=r.fingerprint, eos_token_ids=r.eos_token_ids,
            max_context=self.max_context, max_draft_tokens=self.settings.max_draft_tokens,
            max_new_tokens=self.settings.max_new_tokens, dtype=str(r.dtype).removeprefix("torch."),
            device=str(r.device),
        )

    # -- validation ---------------------------------------------------------------------------
    def check_protocol(self, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise VerifierError(400, "protocol_mismatch", f"protocol_version {version} is not "
                                f"supported; this verifier speaks {PROTOCOL_VERSION}",
                                "protocol_version")

    def check_ids(self, ids: list[int], field: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.runner.vocab_size]
        if bad:
            raise VerifierError(422, "token_out_of_vocab", f"{field} holds ids outside "
                                f"[0, {self.runner.vocab_size}): {bad[:5]}", field)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        self.check_ids(prompt_ids, "prompt_ids")
        if len(prompt_ids) > self.max_prompt:
            raise VerifierError(413, "prompt_too_long", f"prompt_ids has {len(prompt_ids)} "
                                f"tokens; the limit is {self.max_prompt}", "prompt_ids")

    def check_verify(self, session: Session, req: VerifyRequest) -> None:
        k = len(req.draft_ids)
        if k > self.settings.max_draft_tokens:
            raise VerifierError(422, "too_many_drafts", f"draft_ids has {k} tokens; this "
                                f"verifier takes at most {self.settings.max_draft_tokens}",
                                "draft_ids")
        self.check_ids(req.draft_ids, "draft_ids")
        self.check_ids([req.last_token], "last_token")
        if len(req.log_uniforms) != k:
            raise VerifierError(422, "length_mismatch", f"log_uniforms has "
                                f"{len(req.log_uniforms)} entries for {k} drafts", "log_uniforms")
        if req.draft_logprobs is not None and len(req.draft_logprobs) != k:
            raise VerifierError(422, "length_mismatch", f"draft_logprobs has "
                                f"{len(req.draft_logprobs)} entries for {k} drafts",
                                "draft_logprobs")
        if req.position == session.last_verify_position:
            raise VerifierError(409, "step_conflict", f"position {req.position} was already "
                                "verified with a different request; the session is at position "
                                f"{session.position}", "position", position=session.position)
        if req.position != session.position:
            raise VerifierError(409, "position_mismatch", f"position {req.position} does not "
                                f"match the session's position {session.position}", "position",
                                position=session.position)
        if session.position + k > self.max_context:
            raise VerifierError(422, "context_overflow", f"position {session.position} + {k} "
                                f"drafts exceeds max_context {self.max_context}", "draft_ids")

    def allocate_slot(self, busy: set[str]) -> int:
        """A free KV slot; when none is left, the least recently used idle session is evicted
        (its next call gets 404 and the client reopens it). 503 if every slot is busy."""
        while (slot := self.runner.pool.allocate()) is None:
            if not self.sessions.evict_lru(keep=busy):
                raise VerifierError(503, "kv_budget_exhausted", "every KV slot is in use by a "
                                    "call in flight; retry shortly", None, retry_after_s=1)
        return slot

    # -- jobs ---------------------------------------------------------------------------------
    def create_session_job(self, req: CreateSessionRequest,
                           owner: str | None = None) -> CreateSessionJob:
        self.check_protocol(req.protocol_version)
        self.check_prompt(req.prompt_ids)
        return CreateSessionJob(self, req, req.session_id or secrets.token_urlsafe(12), owner,
                                _digest(req))

    def verify_job(self, session_id: str, req: VerifyRequest,
                   owner: str | None = None) -> VerifyJob:
        return VerifyJob(self, session_id, req, owner, _digest(req))

    def delete_session(self, session_id: str, owner: str | None = None) -> None:
        self.sessions.remove(session_id, owner)

    def check_session_quota(self, owner: str | None) -> None:
        limit = self.settings.max_sessions_per_key
        if limit and owner is not None and self.sessions.count_owned(owner) >= limit:
            raise VerifierError(429, "too_many_sessions", f"this API key holds {limit} open "
                                f"sessions, the limit per key (SPECDEC_MAX_SESSIONS_PER_KEY); "
                                "close one or retry later", "session_id", retry_after_s=1)

    async def generate(self, scheduler: Scheduler, req: GenerateRequest,
                       owner: str | None = None) -> GenerateResponse:
        """Target-only decoding (the baseline): a session advanced by verify calls with no
        drafts, each drawing the next token with the same sampling math and our own seed."""
        self.check_protocol(req.protocol_version)
        self.check_prompt(req.prompt_ids)
        if req.max_new_tokens > self.settings.max_new_tokens:
            raise VerifierError(422, "too_many_tokens", f"max_new_tokens {req.max_new_tokens} "
                                f"exceeds the limit {self.settings.max_new_tokens}",
                                "max_new_tokens")
        generator = torch.Generator().manual_seed(req.seed)
        created = await scheduler.submit(self.create_session_job(
            CreateSessionRequest(prompt_ids=req.prompt_ids, sampling=req.sampling), owner))
        session_id, position, last = created.session_id, created.position, req.prompt_ids[-1]
        tokens: list[int] = []
        forward_ms = 0.0
        try:
            steps = min(req.max_new_tokens, self.max_context - len(req.prompt_ids) + 1)
            for _ in range(steps):
                reply = await scheduler.submit(self.verify_job(session_id, VerifyRequest(
                    position=position, last_token=last,
                    final_uniform=float(draw_uniforms(generator, 1)[0])), owner))
                last, position = reply.next_token, reply.position
                forward_ms += reply.forward_ms
                tokens.append(last)
                if req.stop_at_eos and last in self.runner.eos_token_ids:
                    break
        finally:
            scheduler.forget(session_id)
            await scheduler.run(self._drop_quietly, session_id, owner)
        return GenerateResponse(token_ids=tokens, forward_ms=forward_ms,
                                forward_calls=len(tokens))

    def _drop_quietly(self, session_id: str, owner: str | None) -> None:
        if self.sessions.exists(session_id):
            self.sessions.remove(session_id, owner)


def _digest(req: CreateSessionRequest | VerifyRequest) -> str:
    return hashlib.sha256(req.model_dump_json().encode()).hexdigest()


@dataclass
class CreateSessionJob:
    """Prefill the prompt (all but its last token) into a fresh KV slot."""

    service: VerifierService
    req: CreateSessionRequest
    session_id: str
    owner: str | None = None
    digest: str = ""
    slot: int | None = None
    replay: Session | None = None  # a retried create of a session that exists unchanged
    started: float = field(default_factory=time.perf_counter)

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_ids) - 1

    def prepare(self, busy: set[str]) -> ForwardItem | None:
        existing = self.service.sessions.peek(self.session_id)
        if existing is not None:
            if (existing.owner == self.owner and existing.create_digest == self.digest
                    and existing.last_verify_position < 0):
                self.replay = existing  # the same create again (its answer was lost)
                return None
            raise VerifierError(409, "session_exists", f"session {self.session_id!r} already "
                                "exists; choose another id", "session_id")
        self.service.check_session_quota(self.owner)
        self.slot = self.service.allocate_slot(busy)
        return ForwardItem(self.slot, 0, self.req.prompt_ids[:-1], keep_logits=False)

    def finish(self, logits: torch.Tensor | None) -> CreateSessionResponse:
        if self.replay is not None:
            return CreateSessionResponse(session_id=self.replay.id,
                                         position=self.replay.position, prefill_ms=0.0)
        assert self.slot is not None
        session = Session(slot=self.slot, position=len(self.req.prompt_ids),
                          config=self.req.sampling.to_config(), id=self.session_id,
                          owner=self.owner, create_digest=self.digest)
        self.service.sessions.add(session)
        return CreateSessionResponse(session_id=session.id, position=session.position,
                                     prefill_ms=1e3 * (time.perf_counter() - self.started))

    def abort(self) -> None:
        if self.slot is not None and not self.service.sessions.exists(self.session_id):
            self.service.runner.pool.release(self.slot)
            self.slot = None


@dataclass
class VerifyJob:
    """Score [last token, x_1..x_k] on top of the session's cache; keep the accepted prefix."""

    service: VerifierService
    session_id: str
    req: VerifyRequest
    owner: str | None = None
    digest: str = ""
    session: Session | None = None
    replay: VerifyResponse | None = None  # the answer to this very call, already given once
    started: float = field(default_factory=time.perf_counter)

    @property
    def num_tokens(self) -> int:
        return len(self.req.draft_ids) + 1

    def prepare(self, busy: set[str]) -> ForwardItem | None:
        self.session = session = self.service.sessions.get(self.session_id, self.owner)
        if (self.req.position == session.last_verify_position
                and self.digest == session.last_verify_digest):
            self.replay = session.last_reply  # a retry: same answer, the cache moves once
            return None
        self.service.check_verify(session, self.req)
        return ForwardItem(self.session.slot, self.session.position - 1,
                           [self.req.last_token, *self.req.draft_ids], keep_logits=True)

    def finish(self, logits: torch.Tensor | None) -> VerifyResponse:
        if self.replay is not None:
            self.service.replayed_calls += 1
            return self.replay
        session, req = self.session, self.req
        assert session is not None and logits is not None  # [k + 1, vocab]
        draft_lp = (torch.tensor(req.draft_logprobs, dtype=torch.float64)
                    if req.draft_logprobs is not None else None)
        verdict = verify_block(
            logits, torch.tensor(req.draft_ids, dtype=torch.long), draft_lp,
            torch.tensor(req.log_uniforms, dtype=torch.float64), req.final_uniform,
            session.config,
        )
        # The slot holds position + k tokens now; the session keeps last token + accepted.
        session.position += verdict.num_accepted + 1
        self.service.verify_calls += 1
        reply = VerifyResponse(
            num_accepted=verdict.num_accepted,
            target_logprobs=(encode_logprobs(verdict.target_logprobs)
                             if verdict.target_logprobs is not None else None),
            target_argmax=(verdict.target_argmax.tolist()
                           if verdict.target_argmax is not None else None),
            next_token=verdict.next_token,
            row=EncodedRow.encode(verdict.row) if verdict.row is not None else None,
            position=session.position,
            forward_ms=1e3 * (time.perf_counter() - self.started),
            top_ids=(torch.topk(logits, min(req.return_top_ids, logits.shape[-1])).indices
                     .tolist() if req.return_top_ids else None),
        )
        session.last_verify_position, session.last_verify_digest = req.position, self.digest
        session.last_reply = reply
        return reply

    def abort(self) -> None:
        pass  # the session's position did not move; whatever the slot got past it is ignored
