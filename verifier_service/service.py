"""The verifier's request handling, synchronous, on the model thread: validate, run, answer."""

from __future__ import annotations

import time

import torch

from shared.sampling import verify_block
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
from verifier_service.sessions import Session, SessionStore
from verifier_service.settings import Settings
from verifier_service.target import TargetRunner


class VerifierService:
    def __init__(self, runner: TargetRunner, settings: Settings) -> None:
        self.runner, self.settings = runner, settings
        self.sessions = SessionStore(settings.max_sessions, settings.session_ttl_s)
        self.max_context = runner.max_context
        if settings.max_context:
            self.max_context = min(self.max_context, settings.max_context)
        self.max_prompt = settings.max_prompt_tokens or self.max_context - 1
        self.verify_calls = 0

    def info(self) -> InfoResponse:
        r = self.runner
        return InfoResponse(
            protocol_version=PROTOCOL_VERSION, model=r.name, vocab_size=r.vocab_size,
            tokenizer_fingerprint=r.fingerprint, eos_token_ids=r.eos_token_ids,
            max_context=self.max_context, max_draft_tokens=self.settings.max_draft_tokens,
            max_new_tokens=self.settings.max_new_tokens, dtype=str(r.dtype).removeprefix("torch."),
            device=str(r.device),
        )

    # -- validation helpers -------------------------------------------------------------------
    def _check_protocol(self, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise VerifierError(400, "protocol_mismatch", f"protocol_version {version} is not "
                                f"supported; this verifier speaks {PROTOCOL_VERSION}",
                                "protocol_version")

    def _check_ids(self, ids: list[int], field: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.runner.vocab_size]
        if bad:
            raise VerifierError(422, "token_out_of_vocab", f"{field} holds ids outside "
                                f"[0, {self.runner.vocab_size}): {bad[:5]}", field)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        self._check_ids(prompt_ids, "prompt_ids")
        if len(prompt_ids) > self.max_prompt:
            raise VerifierError(413, "prompt_too_long", f"prompt_ids has {len(prompt_ids)} "
                                f"tokens; the limit is {self.max_prompt}", "prompt_ids")

    # -- endpoints ----------------------------------------------------------------------------
    def create_session(self, req: CreateSessionRequest) -> CreateSessionResponse:
        self._check_protocol(req.protocol_version)
        self._check_prompt(req.prompt_ids)
        started = time.perf_counter()
        cache = self.runner.prefill(req.prompt_ids)
        session = Session(cache=cache, position=len(req.prompt_ids),
                          config=req.sampling.to_config())
        if req.session_id is not None:
            if self.sessions.exists(req.session_id):
                raise VerifierError(409, "session_exists", f"session {req.session_id!r} already "
                                    "exists; choose another id", "session_id")
            session.id = req.session_id
        self.sessions.add(session)
        return CreateSessionResponse(session_id=session.id, position=session.position,
                                     prefill_ms=1e3 * (time.perf_counter() - started))

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResponse:
        session = self.sessions.get(session_id)
        k = len(req.draft_ids)
        if k > self.settings.max_draft_tokens:
            raise VerifierError(422, "too_many_drafts", f"draft_ids has {k} tokens; this "
                                f"verifier takes at most {self.settings.max_draft_tokens}",
                                "draft_ids")
        self._check_ids(req.draft_ids, "draft_ids")
        self._check_ids([req.last_token], "last_token")
        if len(req.log_uniforms) != k:
            raise VerifierError(422, "length_mismatch", f"log_uniforms has "
                                f"{len(req.log_uniforms)} entries for {k} drafts", "log_uniforms")
        if req.draft_logprobs is not None and len(req.draft_logprobs) != k:
            raise VerifierError(422, "length_mismatch", f"draft_logprobs has "
                                f"{len(req.draft_logprobs)} entries for {k} drafts",
                                "draft_logprobs")
        if req.position != session.position:
            raise VerifierError(409, "position_mismatch", f"position {req.position} does not "
                                f"match the session's position {session.position}", "position")
        if session.position + k > self.max_context:
            raise VerifierError(422, "context_overflow", f"position {session.position} + {k} "
                                f"drafts exceeds max_context {self.max_context}", "draft_ids")

        started = time.perf_counter()
        draft_lp = (torch.tensor(req.draft_logprobs, dtype=torch.float64)
                    if req.draft_logprobs is not None else None)
        try:
            logits = self.runner.forward(session.cache, [req.last_token, *req.draft_ids])
            verdict = verify_block(
                logits, torch.tensor(req.draft_ids, dtype=torch.long), draft_lp,  # [k + 1, V]
                torch.tensor(req.log_uniforms, dtype=torch.float64), req.final_uniform,
                session.config,
            )
        except Exception:
            self.runner.crop(session.cache, session.position - 1)  # leave the session as it was
            raise
        # The cache now holds position + k tokens; keep the last committed + accepted drafts.
        session.position += verdict.num_accepted + 1
        self.runner.crop(session.cache, session.position - 1)
        self.verify_calls += 1
        return VerifyResponse(
            num_accepted=verdict.num_accepted,
            target_logprobs=(encode_logprobs(verdict.target_logprobs)
                             if verdict.target_logprobs is not None else None),
            target_argmax=(verdict.target_argmax.tolist()
                           if verdict.target_argmax is not None else None),
            next_token=verdict.next_token,
            row=EncodedRow.encode(verdict.row) if verdict.row is not None else None,
            position=session.position,
            forward_ms=1e3 * (time.perf_counter() - started),
            top_ids=(torch.topk(logits, min(req.return_top_ids, logits.shape[-1])).indices
                     .tolist() if req.return_top_ids else None),
        )

    def delete_session(self, session_id: str) -> None:
        self.sessions.remove(session_id)

    def generate(self, req: GenerateRequest) -> GenerateResponse:
        self._check_protocol(req.protocol_version)
        self._check_prompt(req.prompt_ids)
        if req.max_new_tokens > self.settings.max_new_tokens:
            raise VerifierError(422, "too_many_tokens", f"max_new_tokens {req.max_new_tokens} "
                                f"exceeds the limit {self.settings.max_new_tokens}",
                                "max_new_tokens")
        room = self.max_context - len(req.prompt_ids)
        out = self.runner.generate(req.prompt_ids, req.sampling.to_config(),
                                   min(req.max_new_tokens, room), req.seed, req.stop_at_eos)
        return GenerateResponse(token_ids=out.token_ids, forward_ms=1e3 * out.forward_s,
                                forward_calls=out.forward_calls)
