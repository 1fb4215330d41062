"""The speculative decoding loop: draft k, one verify round trip, accept/reject, repeat."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_client.draft_length import DraftLength, FixedLength
from drafter_client.drafters import Draft, Drafter
from drafter_client.metrics import GenerationMetrics
from drafter_client.transport import HttpVerifier, SpecDecError, VerifierHTTPError
from shared.sampling import (
    SamplingConfig,
    accept_drafts,
    accept_greedy,
    draw_uniforms,
    recover_token,
)
from shared.schema import (
    CreateSessionRequest,
    SamplingParams,
    VerifyRequest,
    VerifyResponse,
    decode_logprobs,
)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    metrics: GenerationMetrics
    text: str = ""


def _check_verdict(reply: VerifyResponse, draft: Draft, draft_logprobs: torch.Tensor | None,
                   log_uniforms: torch.Tensor, config: SamplingConfig) -> int:
    """Our own copy of the acceptance rule must agree with the verifier's verdict."""
    ids = torch.tensor(draft.ids, dtype=torch.long)  # [k]
    if config.greedy:
        accepted = accept_greedy(ids, torch.tensor(reply.target_argmax or [], dtype=torch.long))
    else:
        accepted = accept_drafts(decode_logprobs(reply.target_logprobs or []), draft_logprobs,
                                 log_uniforms)
    if accepted != reply.num_accepted:
        raise SpecDecError(f"verifier accepted {reply.num_accepted} drafts where the acceptance "
                           f"rule gives {accepted}: protocol mismatch")
    return accepted


MAX_REOPENS_PER_BLOCK = 3


def _session_lost(exc: VerifierHTTPError) -> bool:
    """The verifier no longer holds our session as we know it: restarted, evicted, expired, or
    at another position (a call we never saw the answer to, then lost on the verifier too)."""
    return ((exc.status == 404 and exc.code == "session_not_found")
            or (exc.status == 409 and exc.code in ("position_mismatch", "step_conflict")))


def speculative_generate(
    verifier: HttpVerifier,
    drafter: Drafter,
    prompt_ids: list[int],
    sampling: SamplingParams,
    num_draft_tokens: int | DraftLength,
    max_new_tokens: int,
    seed: int,
    eos_token_ids: list[int],
    vocab_size: int,
    max_context: int,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens whose distribution is exactly the target's."""
    config = sampling.to_config()
    draft_length = (FixedLength(num_draft_tokens) if isinstance(num_draft_tokens, int)
                    else num_draft_tokens)
    top_ids = int(getattr(drafter, "top_k_filler", 0))  # NASD: the target's top-k per position
    generator = torch.Generator().manual_seed(seed)
    metrics = GenerationMetrics()
    sent_before, received_before, retries_before = (verifier.bytes_sent,
                                                    verifier.bytes_received, verifier.retries)
    started = time.perf_counter()
    committed = list(prompt_ids)
    session_id: str | None = None

    def open_session() -> str:
        """A session holding every committed token; its position is len(committed)."""
        return verifier.create_session(CreateSessionRequest(prompt_ids=committed,
                                                            sampling=sampling)).session_id

    def verify(req: VerifyRequest) -> VerifyResponse:
        """One verify call; when the session is lost, reopen it with the committed tokens and
        send the very same request again (same position, same uniforms), so the output is what
        an undisturbed run gives."""
        nonlocal session_id
        for _ in range(MAX_REOPENS_PER_BLOCK):
            assert session_id is not None
            try:
                return verifier.verify(session_id, req)
            except VerifierHTTPError as exc:
                if not _session_lost(exc):
                    raise
                if exc.status == 409:  # it still exists, at a position we cannot use
                    with contextlib.suppress(SpecDecError):
                        verifier.delete_session(session_id)
            session_id = open_session()
            metrics.session_reopens += 1
        raise SpecDecError(f"the verifier lost this generation's session "
                           f"{MAX_REOPENS_PER_BLOCK} times in one block; giving up")

    try:
        session_id = open_session()
        metrics.prefill_s = time.perf_counter() - started
        drafter.reset(prompt_ids)
        while len(committed) - len(prompt_ids) < max_new_tokens and len(committed) <= max_context:
            # 1. Draft: a block yields up to k + 1 tokens and needs position + k <= context.
            remaining = max_new_tokens - (len(committed) - len(prompt_ids))
            k = max(0, min(draft_length.next_k(), remaining - 1, max_context - len(committed)))
            t0 = time.perf_counter()
            draft = drafter.propose(k, config, generator)
            k = len(draft.ids)  # a drafter may stop early
            t1 = time.perf_counter()
            # 2. Our randomness for the verdict: k acceptance uniforms + 1 for the last token.
            #    log(1 - u) with u in [0, 1) is the log of a uniform on (0, 1], never -inf.
            uniforms = draw_uniforms(generator, k + 1)  # [k + 1]
            log_uniforms = torch.log1p(-uniforms[:k])  # [k]
            draft_logprobs = None if config.greedy else draft.logprobs  # None: one-hot draft
            # 3. One round trip: the verifier scores [last token, x_1..x_k] in one forward.
            reply = verify(VerifyRequest(
                position=len(committed), last_token=committed[-1], draft_ids=draft.ids,
                draft_logprobs=None if draft_logprobs is None else draft_logprobs.tolist(),
                log_uniforms=log_uniforms.tolist(), final_uniform=float(uniforms[k]),
                return_top_ids=top_ids,
            ))
            t2 = time.perf_counter()
            accepted = _check_verdict(reply, draft, draft_logprobs, log_uniforms, config)
            # 4. The recovered or bonus token: drawn by the verifier when it could, else here
            #    from norm(max(0, p_j - q_j)) with p_j from the reply and our own q_j.
            if reply.next_token is not None:
                next_token = reply.next_token
            elif reply.row is not None and draft.probs is not None:
                next_token = recover_token(reply.row.decode(vocab_size), draft.probs[accepted],
                                           float(uniforms[k]))
            else:
                raise SpecDecError("verifier sent neither the next token nor the target row")
            # 5. Commit accepted drafts + one token, cut at EOS; tell the drafter.
            new_tokens = [*draft.ids[:accepted], next_token]
            eos_at = next((i for i, t in enumerate(new_tokens) if t in eos_token_ids), None)
            if eos_at is not None:
                new_tokens = new_tokens[: eos_at + 1]
            if reply.top_ids is not None and hasattr(drafter, "observe_top_k"):
                for i in range(accepted + 1):  # row i follows committed + x_1..x_i
                    drafter.observe_top_k([*committed, *draft.ids[:i]], reply.top_ids[i])
            committed.extend(new_tokens)
            drafter.commit(new_tokens)
            metrics.record_block(k, accepted)
            metrics.drafting_s += t1 - t0
            metrics.verify_rtt_s += t2 - t1
            metrics.verify_latencies_s.append(t2 - t1)
            metrics.verify_forward_s += reply.forward_ms / 1e3
            draft_length.update(k, accepted, t1 - t0, t2 - t1)
            if on_tokens is not None:
                on_tokens(new_tokens)
            if eos_at is not None:
                break
    except SpecDecError as exc:  # keep what was generated: the caller reports it as partial
        exc.partial = _result(prompt_ids, committed, metrics, verifier, started,
                              (sent_before, received_before, retries_before))
        raise
    finally:
        if session_id is not None:
            with contextlib.suppress(SpecDecError):  # else it expires on the verifier
                verifier.delete_session(session_id)
    return _result(prompt_ids, committed, metrics, verifier, started,
                   (sent_before, received_before, retries_before))


def _result(prompt_ids: list[int], committed: list[int], metrics: GenerationMetrics,
            verifier: HttpVerifier, started: float,
            before: tuple[int, int, int]) -> GenerationResult:
    generated = committed[len(prompt_ids):]
    metrics.new_tokens = len(generated)
    metrics.wall_s = time.perf_counter() - started
    metrics.bytes_sent = verifier.bytes_sent - before[0]
    metrics.bytes_received = verifier.bytes_received - before[1]
    metrics.retries = verifier.retries - before[2]
    return GenerationResult(list(prompt_ids), generated, metrics)
