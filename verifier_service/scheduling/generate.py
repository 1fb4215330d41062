"""Target-only decoding: the baseline behind ``/v1/generate`` - a session advanced by verify jobs
with no drafts, each drawing the next token with the same sampling math and our own seed, or beam
search (``num_beams`` > 1, :mod:`verifier_service.scheduling.beam`) - and a verify call's plain run
(``more_uniforms``: the same plain steps on a client's session, one round trip for them all)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import torch

from shared.engines.target import ForwardItem, Step, StepResult
from shared.protocol.acceptance import Block
from shared.protocol.grammar import Constraint, GrammarDeadEnd, GrammarError
from shared.protocol.sampling import draw_uniforms
from shared.protocol.schema import (
    CreateSessionRequest,
    CreateSessionResponse,
    GenerateRequest,
    GenerateResponse,
    LogprobsEntry,
    RowMask,
    VerifyRequest,
    VerifyResponse,
)
from verifier_service.errors import VerifierError
from verifier_service.scheduling.beam import beam_generate, check_beam_request
from verifier_service.scheduling.jobs import (
    CreateSessionJob,
    JobContext,
    VerifyJob,
    request_digest,
)
from verifier_service.scheduling.scheduler import Scheduler
from verifier_service.scheduling.sessions import busy_error


@dataclass
class FirstTokenJob(CreateSessionJob):
    """Prefill the whole prompt and draw the first token from its last row with ``uniform``, as
    generate() does, instead of leaving the last prompt token to the first step (one forward
    fewer per generation). Answers (the created session, the first token)."""

    uniform: float = 0.0
    logprobs: int | None = None  # also the first token's log-probabilities (and n best)
    masks: list[RowMask] | None = None  # structured output: what the grammar allows first
    keep: torch.Tensor | None = None  # those masks decoded (off the model thread)

    def step(self, slot: int) -> Step:
        ids = self.req.prompt_ids
        return Step(ForwardItem(slot, 0, ids, keep_logits=True, keep_from=len(ids) - 1),
                    Block([], None, [], self.uniform, self.req.sampling.to_config(), len(ids),
                          logprobs=self.logprobs,
                          masks=tuple(self.masks) if self.masks is not None else None,
                          keep=self.keep))

    def finish(self, result: StepResult  # type: ignore[override]
               ) -> tuple[CreateSessionResponse, int, list[LogprobsEntry]]:
        verdict = result.decided()
        token = verdict.next_token
        assert token is not None  # a block without drafts: the next token is always drawn
        entries = [LogprobsEntry.of(e) for e in verdict.logprobs or []]
        # the cache holds the prompt; the first token is committed
        return self.open(len(self.req.prompt_ids) + 1), token, entries


async def grammar_of(ctx: JobContext, req: GenerateRequest) -> Constraint | None:
    """The request's grammar at its start, compiled off the event loop (None: no grammar)."""
    if req.grammar is None:
        return None
    info = ctx.engine.info
    if info.tokenizer is None:
        raise VerifierError(422, "grammar_unsupported", "this engine loaded no tokenizer to "
                            "read a grammar with", "grammar")
    try:
        return await asyncio.to_thread(Constraint.of, req.grammar, info.tokenizer,
                                       info.vocab_size, info.eos_token_ids)
    except GrammarError as exc:
        raise VerifierError(422, "bad_grammar", str(exc), "grammar") from None


def next_masks(grammar: Constraint | None) -> list[RowMask] | None:
    """The next step's one row mask: what the grammar allows after the tokens so far (422 when
    no token of the vocabulary can go on with it)."""
    if grammar is None:
        return None
    try:
        allowed = grammar.allowed_after([])
    except GrammarError as exc:  # llguidance gave up on it (a lexer or parser limit)
        raise VerifierError(422, "grammar_dead_end", str(exc), "grammar") from None
    assert allowed is not None  # no drafts: the committed tokens alone
    if not allowed.any():
        raise VerifierError(422, "grammar_dead_end", "no token of this vocabulary can continue "
                            "the grammar here", "grammar")
    return [RowMask.of(allowed)]


async def decoded_masks(ctx: JobContext, scheduler: Scheduler, req: VerifyRequest
                        ) -> torch.Tensor | None:
    """The call's row masks decoded aside (``Scheduler.aside``: a worker thread) before it is
    queued: the caller's own work, not the batch's (the model thread then only applies them)."""
    if req.masks is None:
        return None
    return await scheduler.aside(ctx.validator.decode_masks, req)


def advance(grammar: Constraint | None, token: int) -> None:
    """The grammar after ``token`` (which its mask allowed; llguidance may still refuse a token
    that only spells part of what it forces: 422 naming the grammar)."""
    if grammar is None:
        return
    try:
        grammar.commit([token])
    except GrammarError as exc:
        message = str(exc) if isinstance(exc, GrammarDeadEnd) else \
            f"the grammar cannot go on: {exc}"
        raise VerifierError(422, "grammar_dead_end", message, "grammar") from None


async def generate(ctx: JobContext, scheduler: Scheduler, req: GenerateRequest,
                   eos_token_ids: list[int], owner: str | None = None,
                   gone: asyncio.Event | None = None) -> GenerateResponse:
    """``gone`` set (the caller hung up): stop before the next step; the session is freed and
    the tokens so far are answered to nobody. Never in the middle of a job, whose session would
    then outlive the call."""
    ctx.validator.check_create(req.protocol_version, req.prompt_ids, req.encoder_ids,
                               sampling=req.sampling)
    ctx.validator.check_new_tokens(req.max_new_tokens)
    check_beam_request(req)
    if req.num_beams > 1:
        return await beam_generate(ctx, scheduler, req, eos_token_ids, owner)
    grammar = await grammar_of(ctx, req)
    generator = torch.Generator().manual_seed(req.seed)
    fused = req.encoder_ids is None  # decoder-only: the prefill draws the first token
    create_req = CreateSessionRequest(prompt_ids=req.prompt_ids, sampling=req.sampling,
                                      encoder_ids=req.encoder_ids)
    first: int | None = None
    logprobs: list[LogprobsEntry] = []
    if fused:
        masks = next_masks(grammar)
        keep = None if masks is None else await scheduler.aside(ctx.validator.decode_rows,
                                                                masks)
        created, first, logprobs = await scheduler.submit(FirstTokenJob(
            ctx, create_req, owner, uniform=float(draw_uniforms(generator, 1)[0]),
            logprobs=req.logprobs, masks=masks, keep=keep))
    else:
        created = await scheduler.submit(CreateSessionJob(ctx, create_req, owner))
    session_id, position, last = created.session_id, created.position, req.prompt_ids[-1]
    tokens: list[int] = []
    counts: Counter[int] = Counter()  # of the generated tokens: what penalties read
    forward_ms = 0.0
    penalized = req.sampling.to_config().penalized
    try:
        steps = min(req.max_new_tokens, ctx.validator.max_context - len(req.prompt_ids) + 1)
        if first is not None and steps:
            last = first
            tokens.append(last)
            counts[last] += 1
            advance(grammar, last)
            steps -= 1
            if req.stop_at_eos and last in eos_token_ids:
                steps = 0
        for _ in range(steps):
            if gone is not None and gone.is_set():
                break
            step = VerifyRequest(position=position, last_token=last, logprobs=req.logprobs,
                                 history=list(counts.items()) if penalized else [],
                                 masks=next_masks(grammar),
                                 final_uniform=float(draw_uniforms(generator, 1)[0]))
            keep = await decoded_masks(ctx, scheduler, step)
            try:
                reply = await scheduler.submit(VerifyJob(ctx, session_id, step, owner,
                                                         keep=keep))
            except VerifierError as exc:
                if exc.code != "session_not_found":
                    raise
                # The session is this request's own: its id means nothing to the caller.
                raise busy_error("the KV pool is full and this generation's session was "
                                 "evicted (expired)") from None
            last, position = reply.next_token, reply.position
            forward_ms += reply.forward_ms
            tokens.append(last)
            counts[last] += 1
            advance(grammar, last)
            logprobs.extend(reply.logprobs or [])
            if req.stop_at_eos and last in eos_token_ids:
                break
    finally:
        scheduler.forget((owner, session_id))
        await scheduler.run(ctx.sessions.discard, session_id, owner)
    return GenerateResponse(token_ids=tokens, forward_ms=forward_ms, forward_calls=len(tokens),
                            logprobs=logprobs[:len(tokens)] if req.logprobs is not None
                            else None)


async def verify_call(ctx: JobContext, scheduler: Scheduler, session_id: str,
                      req: VerifyRequest, eos_token_ids: list[int],
                      owner: str | None = None) -> VerifyResponse:
    """A verify call: one job, then for a plain run one more plain step per entry of
    ``more_uniforms`` (each an ordinary job, batched with other sessions' work), stopping
    after an EOS id or at the context's end. The answer is remembered for the whole call, so
    the same call again gets it again - while the run is still going, once it is whole."""
    if req.masks is not None:
        return await scheduler.submit(  # type: ignore[no-any-return]
            VerifyJob(ctx, session_id, req, owner, keep=await decoded_masks(ctx, scheduler, req)))
    if not req.more_uniforms:
        return await scheduler.submit(VerifyJob(ctx, session_id, req, owner))  # type: ignore[no-any-return]
    key = (owner, session_id, request_digest(req))
    running = ctx.plain_runs.get(key)
    if running is not None:  # a retry of a run in progress (its first answer was lost)
        answer: asyncio.Future[VerifyResponse | None] = \
            asyncio.get_running_loop().create_future()
        running.append(answer)
        whole = await answer
        if whole is not None:
            return whole
        # the first call was cancelled before its run was whole: run this one on its own
    waiters: list[asyncio.Future[VerifyResponse | None]] = []
    ctx.plain_runs[key] = waiters
    whole = None
    try:
        whole = await _plain_run(ctx, scheduler, session_id, req, eos_token_ids, owner)
        return whole
    except Exception as exc:
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)
        waiters.clear()
        raise
    finally:
        if ctx.plain_runs.get(key) is waiters:
            del ctx.plain_runs[key]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(whole)


async def _plain_run(ctx: JobContext, scheduler: Scheduler, session_id: str,
                     req: VerifyRequest, eos_token_ids: list[int],
                     owner: str | None) -> VerifyResponse:
    job = VerifyJob(ctx, session_id, req, owner)
    first: VerifyResponse = await scheduler.submit(job)
    if job.replay is not None:
        return first
    assert first.next_token is not None  # a step without drafts draws its token
    assert job.session is not None
    penalized = job.session.config.penalized
    last, position, forward_ms = first.next_token, first.position, first.forward_ms
    load = first.load
    tokens: list[int] = []
    counts = Counter(dict(req.history))  # the generated tokens so far, for penalties
    counts[last] += 1
    logprobs = list(first.logprobs or [])
    for uniform in req.more_uniforms:
        if last in eos_token_ids or position > ctx.validator.max_context:
            break
        reply = await scheduler.submit(VerifyJob(ctx, session_id, VerifyRequest(
            position=position, last_token=last, final_uniform=uniform,
            logprobs=req.logprobs,
            history=list(counts.items()) if penalized else []),
            owner))
        assert reply.next_token is not None
        last, position, load = reply.next_token, reply.position, reply.load
        forward_ms += reply.forward_ms
        tokens.append(last)
        counts[last] += 1
        logprobs.extend(reply.logprobs or [])
    whole = first.model_copy(update={
        "position": position, "more_tokens": tokens, "forward_ms": forward_ms, "load": load,
        "logprobs": logprobs if req.logprobs is not None else None})
    await scheduler.run(remember, ctx, session_id, owner, req, job.digest, whole)
    return whole


def remember(ctx: JobContext, session_id: str, owner: str | None, req: VerifyRequest,
              digest: str, reply: VerifyResponse) -> None:
    """Model thread: the session's last answer is the whole run's (for a retried call)."""
    session = ctx.sessions.peek(session_id, owner)
    if session is not None:
        session.last_verify_position, session.last_verify_digest = req.position, digest
        session.last_reply = reply
