"""The speculative decoding loop: draft k, one verify round trip, accept/reject, repeat."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter_client.drafters import Drafter
from drafter_client.metrics import GenerationMetrics
from drafter_client.transport import HttpVerifier, SpecDecError
from shared.sampling import accept_drafts, accept_greedy, draw_uniforms, recover_token
from shared.schema import CreateSessionRequest, SamplingParams, VerifyRequest, decode_logprobs


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    metrics: GenerationMetrics
    text: str = ""


def speculative_generate(
    verifier: HttpVerifier,
    drafter: Drafter,
    prompt_ids: list[int],
    sampling: SamplingParams,
    num_draft_tokens: int,
    max_new_tokens: int,
    seed: int,
    eos_token_ids: list[int],
    vocab_size: int,
    max_context: int,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens whose distribution is exactly the target's."""
    config = sampling.to_config()
    generator = torch.Generator().manual_seed(seed)
    metrics = GenerationMetrics()
    sent_before, received_before = verifier.bytes_sent, verifier.bytes_received
    started = time.perf_counter()
    session = verifier.create_session(CreateSessionRequest(prompt_ids=prompt_ids,
                                                           sampling=sampling))
    metrics.prefill_s = time.perf_counter() - started
    drafter.reset(prompt_ids)
    generated: list[int] = []
    position = len(prompt_ids)
    try:
        while len(generated) < max_new_tokens and position <= max_context:
            # 1. Block size: a block yields up to k + 1 tokens and needs position + k <= context.
            k = max(0, min(num_draft_tokens, max_new_tokens - len(generated) - 1,
                           max_context - position))
            t0 = time.perf_counter()
            draft = drafter.propose(k, config, generator)
            t1 = time.perf_counter()
            # 2. Our randomness for the verdict: k acceptance uniforms + 1 for the last token.
            #    log(1 - u) with u in [0, 1) is the log of a uniform on (0, 1], never -inf.
            uniforms = draw_uniforms(generator, k + 1)  # [k + 1]
            log_uniforms = torch.log1p(-uniforms[:k])  # [k]
            draft_logprobs = None if config.greedy else draft.logprobs  # None: one-hot draft
            reply = verifier.verify(session.session_id, VerifyRequest(
                position=position,
                last_token=prompt_ids[-1] if not generated else generated[-1],
                draft_ids=draft.ids,
                draft_logprobs=None if draft_logprobs is None else draft_logprobs.tolist(),
                log_uniforms=log_uniforms.tolist(),
                final_uniform=float(uniforms[k]),
            ))
            t2 = time.perf_counter()
            # 3. Re-check the verifier's verdict with our own copy of the acceptance rule.
            ids = torch.tensor(draft.ids, dtype=torch.long)
            if config.greedy:
                accepted = accept_greedy(ids, torch.tensor(reply.target_argmax or []))
            else:
                accepted = accept_drafts(decode_logprobs(reply.target_logprobs or []),
                                         draft_logprobs, log_uniforms)
            if accepted != reply.num_accepted:
                raise SpecDecError(f"verifier accepted {reply.num_accepted} drafts where the "
                                   f"acceptance rule gives {accepted}: protocol mismatch")
            # 4. The recovered or bonus token: drawn by the verifier when it could, else here from
            #    norm(max(0, p_j - q_j)) with p_j from the reply and our own q_j.
            if reply.next_token is not None:
                next_token = reply.next_token
            elif reply.row is not None and draft.probs is not None:
                next_token = recover_token(reply.row.decode(vocab_size), draft.probs[accepted],
                                           float(uniforms[k]))
            else:
                raise SpecDecError("verifier sent neither the next token nor the target row")
            # 5. Commit: accepted drafts + one token, cut at EOS.
            new_tokens = [*draft.ids[:accepted], next_token]
            for i, token in enumerate(new_tokens):
                if token in eos_token_ids:
                    new_tokens = new_tokens[: i + 1]
                    break
            generated.extend(new_tokens)
            position = reply.position
            drafter.commit(new_tokens)
            metrics.record_block(k, accepted)
            metrics.drafting_s += t1 - t0
            metrics.verify_rtt_s += t2 - t1
            metrics.verify_forward_s += reply.forward_ms / 1e3
            if on_tokens is not None:
                on_tokens(new_tokens)
            if new_tokens[-1] in eos_token_ids:
                break
    finally:
        with contextlib.suppress(SpecDecError):  # else it expires on the verifier by itself
            verifier.delete_session(session.session_id)
    metrics.new_tokens = len(generated)
    metrics.wall_s = time.perf_counter() - started
    metrics.bytes_sent = verifier.bytes_sent - sent_before
    metrics.bytes_received = verifier.bytes_received - received_before
    return GenerationResult(list(prompt_ids), generated, metrics)
