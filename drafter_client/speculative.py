"""The speculative decoding loop (Leviathan et al. 2023, Algorithm 1), in three parts:

* :class:`VerifierSession` - the verifier's copy of this generation: every committed token in a
  KV cache on the verifier. It owns open / reopen-on-loss / close.
* :func:`speculative_block` - one block: draft k, one verify round trip over
  ``[last committed token, x_1..x_k]``, accept / recover / bonus. Returns a :class:`BlockOutcome`.
* :func:`speculative_generate` - the driver: propose (the policy's :class:`BlockPlan`), verify
  (one block), commit, until ``max_new_tokens``, EOS or the context limit. The policy
  (``policy.py``) chooses each block's shape and learns from its outcome.

Terms (as in ``shared/protocol/acceptance.py``): *accepted* drafts passed the ratio test, the
*recovered* token is drawn from norm(max(0, p - q)) at the first rejection, the *bonus* token
from p after a fully accepted block; output tokens per block = accepted + 1.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from drafter_client.draft_length import DraftLength, FixedLength
from drafter_client.errors import GrammarRefused
from drafter_client.metrics import GenerationMetrics, MetricsRecorder
from drafter_client.outcome import BlockOutcome, TokenLogprob
from drafter_client.policy import BlockPlan, BlockPolicy
from drafter_client.prediction import PredictionCounts
from drafter_client.reply_checks import read_verdict
from drafter_client.transport import SpecDecError, Verifier, VerifierHTTPError
from shared.engines.drafter import Draft, Drafter
from shared.protocol.acceptance import Block, recover_token
from shared.protocol.grammar import Constraint, GrammarDeadEnd, GrammarError
from shared.protocol.sampling import SamplingConfig, draw_uniforms, penalize
from shared.protocol.schema import (
    CreateSessionRequest,
    InfoResponse,
    LogprobsEntry,
    SamplingParams,
    VerifyRequest,
    VerifyResponse,
)

MAX_REOPENS_PER_BLOCK = 3


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    metrics: GenerationMetrics
    text: str = ""
    # "stop": an EOS token; "length": max_new_tokens; "context": the verifier's context limit;
    # "error": cut short by an unrecoverable error (a partial result)
    finish_reason: str = "length"
    prediction: PredictionCounts | None = None  # with a prediction (Predicted Outputs)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked


def finish_reason(token_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> str:
    if token_ids and token_ids[-1] in eos_token_ids:
        return "stop"
    return "length" if len(token_ids) >= max_new_tokens else "context"


@dataclass(frozen=True)
class GenerationSettings:
    """What one generation asks for; the verifier's limits come from its ``InfoResponse``."""

    sampling: SamplingParams
    max_new_tokens: int
    draft_length: DraftLength | int  # k per block, fixed or adaptive
    seed: int = 0
    encoder_ids: list[int] | None = None  # an encoder-decoder target's source
    # Draft block n + 1 while block n is verified, assuming block n's drafts all pass and the
    # bonus token is the drafter's own choice; used when that holds (drafter_client/hybrid.py,
    # HFDrafter.speculate). Exact: the draft ahead uses its own randomness.
    overlap: bool = False
    # the target's raw log-probability of every generated token and of this many best
    # alternatives at each (OpenAI's logprobs / top_logprobs); None: not asked
    logprobs: int | None = None

    def draft_schedule(self) -> DraftLength:
        return (FixedLength(self.draft_length) if isinstance(self.draft_length, int)
                else self.draft_length)


@dataclass
class InFlight:
    """Drafting the next block while this one is verified (``GenerationSettings.overlap``)."""

    pool: ThreadPoolExecutor
    drafter: Drafter
    k: int
    config: SamplingConfig
    generator: torch.Generator
    room: int  # tokens the generation may still add, this block's included
    ahead: tuple[list[int], Draft] | None = None  # (tokens it assumes this block outputs, draft)
    drafting_s: float = 0.0

    def work(self, draft: Draft) -> None:
        t0 = time.perf_counter()
        assumed = draft.first_chain()  # what the block outputs if every first test passes
        if len(assumed) + 1 >= self.room:
            return  # then this block ends the generation: no block follows to draft for
        made = self.drafter.speculate(assumed, self.k, self.config, self.generator)
        if made is not None:
            guess, next_draft = made
            self.ahead = ([*assumed, guess], next_draft)
        self.drafting_s = time.perf_counter() - t0

    def take(self, tokens: list[int]) -> Draft | None:
        """The draft made ahead, if the block output what it assumed."""
        if self.ahead is not None and self.ahead[0] == tokens:
            return self.ahead[1]
        return None


def _session_lost(exc: VerifierHTTPError) -> bool:
    """The verifier no longer holds our session as we know it: restarted, evicted, expired, or
    at another position (a call we never saw the answer to, then lost on the verifier too)."""
    return ((exc.status == 404 and exc.code == "session_not_found")
            or (exc.status == 409 and exc.code in ("position_mismatch", "step_conflict")))


class VerifierSession:
    """The committed sequence, mirrored in a session on the verifier (position = len(committed)).

    When the verifier loses the session (restart, eviction, expiry), ``verify`` reopens it with
    every committed token - saying how many were the prompt, so an engine writes the generated
    rest as its steps wrote it - and sends the very same request again (same position, same
    uniforms), so the output is what an undisturbed run gives.
    """

    def __init__(self, verifier: Verifier, sampling: SamplingParams,
                 prompt_ids: list[int], encoder_ids: list[int] | None = None,
                 logprobs: int | None = None, constraint: Constraint | None = None) -> None:
        self.verifier, self.sampling, self.encoder_ids = verifier, sampling, encoder_ids
        self.constraint = constraint  # structured output: the grammar's state
        self.logprobs = logprobs  # asked of every verify call (``GenerationSettings``)
        self.config = sampling.to_config()  # how both sides process logits
        self.committed = list(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self.session_id: str | None = None
        self.reopens = 0
        self.counts: Counter[int] = Counter()  # each generated token's count (for penalties)

    @property
    def position(self) -> int:
        return len(self.committed)

    def open(self) -> None:
        reopened = len(self.committed) > self.prompt_length
        self.session_id = self.verifier.create_session(CreateSessionRequest(
            prompt_ids=self.committed, sampling=self.sampling, encoder_ids=self.encoder_ids,
            prompt_length=self.prompt_length if reopened else None)).session_id

    def verify(self, req: VerifyRequest) -> VerifyResponse:
        for _ in range(MAX_REOPENS_PER_BLOCK):
            assert self.session_id is not None, "open() the session first"
            try:
                return self.verifier.verify(self.session_id, req)
            except VerifierHTTPError as exc:
                if not _session_lost(exc):
                    raise
                if exc.status == 409:  # it still exists, at a position we cannot use
                    with contextlib.suppress(SpecDecError):
                        self.verifier.delete_session(self.session_id)
            self.open()
            self.reopens += 1
        raise SpecDecError(f"the verifier lost this generation's session "
                           f"{MAX_REOPENS_PER_BLOCK} times in one block; giving up")

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)
        if self.constraint is not None:
            try:
                self.constraint.commit(tokens)
            except GrammarDeadEnd:
                raise
            except GrammarError as exc:
                raise SpecDecError(f"the verifier returned {exc}") from None
        self.counts.update(tokens)

    def shape_row(self, sequence: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A drafted row as the target's row there will be (``Drafter.shape``): penalised by
        the generated tokens and the drafts before it, masked to what the grammar allows after
        them. [vocab] logits after ``sequence`` (the committed tokens, then drafts)."""
        drafts = sequence[len(self.committed):]
        if self.config.penalized:
            logits = penalize(logits[None], self.config, dict(self.counts), [drafts])[0]
        allowed = self.constraint.allowed_after(drafts) if self.constraint is not None else None
        if allowed is not None and allowed.any():  # None: a draft ahead the grammar refuses
            logits = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
        return logits

    def history(self) -> tuple[tuple[int, int], ...]:
        """What a block's penalties read: every generated token's count (none without)."""
        return tuple(self.counts.items()) if self.config.penalized else ()

    def close(self) -> None:
        if self.session_id is not None:
            with contextlib.suppress(SpecDecError):  # else it expires on the verifier
                self.verifier.delete_session(self.session_id)
            self.session_id = None


def speculative_block(session: VerifierSession, drafter: Drafter, plan: BlockPlan,
                      generator: torch.Generator, info: InfoResponse,
                      drafted: Draft | None = None,
                      in_flight: InFlight | None = None) -> BlockOutcome:
    """One block of Algorithm 1 after ``session.committed``, shaped by ``plan``; commits
    nothing itself. ``drafted``: a draft made ahead (while the previous block was in flight).
    ``in_flight``: work to do while the verify call is on the wire (it runs on a worker thread
    meanwhile)."""
    config = session.config
    # 1. Draft k tokens x_1..x_k with their q_i (a drafter may stop early), or a token tree.
    t0 = time.perf_counter()
    proposed = drafted if drafted is not None else drafter.propose(plan.k, config, generator)
    draft = proposed.limited(plan.depth,
                             min(info.max_draft_tokens, info.max_context - session.position))
    masks = None
    if session.constraint is not None:  # the grammar's mask of every row; its drafts only
        if draft.parents is not None:
            draft = Draft(draft.first_chain(), None, None)
        allowed, masks = session.constraint.block(draft.ids)
        draft = draft.limited(allowed, allowed)
    k = len(draft.ids)
    t1 = time.perf_counter()
    # 2. Our randomness for the verdict: k acceptance uniforms + 1 for the last token (and a
    #    plain run's: one per extra step). log(1 - u) with u in [0, 1) is the log of a uniform
    #    on (0, 1], never -inf.
    more = plan.plain_run if k == 0 and masks is None else 0  # a grammar masks step by step
    uniforms = draw_uniforms(generator, k + 1 + more)  # [k + 1 + more]
    log_uniforms = torch.log1p(-uniforms[:k])  # [k]
    draft_logprobs = None if config.deterministic else draft.logprobs  # None: one-hot draft
    # 3. One round trip: the verifier scores [last token, x_1..x_k] in one forward and finds
    #    the first rejection with our uniforms.
    block = Block(draft.ids, None if draft_logprobs is None else draft_logprobs.tolist(),
                  log_uniforms.tolist(), float(uniforms[k]), config, session.position,
                  draft.parents, drafter.top_k_filler, session.logprobs, session.history(),
                  tuple(masks) if masks is not None else None)
    req = VerifyRequest.of(block, session.committed[-1], uniforms[k + 1:].tolist())
    if in_flight is None:
        reply = session.verify(req)
    else:
        call = in_flight.pool.submit(session.verify, req)
        in_flight.work(draft)
        reply = call.result()
    t2 = time.perf_counter()
    verdict = read_verdict(reply, req, block, info)  # its shape, its row, the rule
    accepted = verdict.num_accepted
    # 4. The recovered or bonus token: drawn by the verifier when it could, else here from
    #    norm(max(0, p_j - q_j)) with p_j from the reply and our own q_j.
    if verdict.next_token is not None:
        next_token = verdict.next_token
    elif verdict.row is not None and draft.probs is not None:
        next_token = recover_token(verdict.row, draft.probs[accepted], float(uniforms[k]))
    else:
        raise SpecDecError("the verifier sent an invalid reply: a row for a one-hot draft")
    # 5. Output: accepted drafts (a tree: along the accepted path) + one token, cut after an EOS.
    path = verdict.path if draft.parents is not None else list(range(accepted))
    assert path is not None
    tokens = [*(draft.ids[node] for node in path), next_token, *(reply.more_tokens or [])]
    logprobs = (read_logprobs(reply.logprobs, tokens, info.vocab_size)
                if session.logprobs is not None else None)
    eos_at = next((i for i, t in enumerate(tokens) if t in info.eos_token_ids), None)
    if eos_at is not None:
        tokens = tokens[: eos_at + 1]
        logprobs = logprobs[: eos_at + 1] if logprobs is not None else None
    # 6. NASD filler: the target's top ids at every position it scored on the kept path.
    if verdict.top_ids is not None:
        kept = [draft.ids[node] for node in path]
        scored = [0, *(node + 1 for node in path)]  # row 0 follows the root, row i + 1 node i
        for i, at in enumerate(scored):
            drafter.observe_top_k([*session.committed, *kept[:i]], verdict.top_ids[at])
    return BlockOutcome(draft.ids, accepted, tokens, eos_at is not None,
                        drafting_s=t1 - t0, round_trip_s=t2 - t1,
                        verifier_s=reply.forward_ms / 1e3,
                        depth=draft.depth,
                        parents=draft.parents, accepted_path=verdict.path,
                        drafted_ahead=drafted is not None,
                        draft_price_s=reply.load.draft_price_ms / 1e3 if reply.load else 0.0,
                        logprobs=logprobs)


def read_logprobs(entries: list[LogprobsEntry] | None, tokens: list[int],
                  vocab_size: int) -> list[TokenLogprob]:
    """A reply's log-probabilities of ``tokens`` (what it output, before an EOS cut): one
    entry per token, a token we drew ourselves looked up in its row's support; SpecDecError
    for entries that do not fit."""
    if entries is None or len(entries) != len(tokens):
        raise SpecDecError(f"the verifier sent an invalid reply: {len(entries or [])} "
                           f"logprobs entries for {len(tokens)} tokens")
    out = []
    for token, wire in zip(tokens, entries, strict=True):
        try:
            entry = wire.entry()
            logprob = entry.of(token)
        except ValueError as exc:
            raise SpecDecError(f"the verifier sent an invalid reply: logprobs: {exc}") from exc
        if any(not 0 <= i < vocab_size for i, _ in entry.top):
            raise SpecDecError("the verifier sent an invalid reply: logprobs ids outside "
                               "the vocabulary")
        out.append(TokenLogprob(token, logprob, entry.top))
    return out


def speculative_generate(
    verifier: Verifier,
    drafter: Drafter,
    prompt_ids: list[int],
    settings: GenerationSettings,
    info: InfoResponse,
    on_block: Callable[[BlockOutcome], bool | None] | None = None,
    constraint: Constraint | None = None,
) -> GenerationResult:
    """Generate up to ``settings.max_new_tokens`` tokens whose distribution is exactly the
    target's (with ``constraint``: the target's under that grammar, every row masked to what
    it allows; a fresh one per generation). ``on_block`` sees every block as it is committed;
    when it returns True the generation ends there with finish_reason "stop" (a stop string,
    a client gone; ending early leaves the distribution of what came before unchanged). On an
    unrecoverable error the :class:`SpecDecError` carries what was generated
    (``exc.partial``)."""
    session = VerifierSession(verifier, settings.sampling, prompt_ids, settings.encoder_ids,
                              settings.logprobs, constraint)
    policy = BlockPolicy(settings.draft_schedule(), drafter, info.max_context,
                         info.max_draft_tokens)
    generator = torch.Generator().manual_seed(settings.seed)
    recorder = MetricsRecorder(verifier)
    stopped = False

    def result(error: bool = False) -> GenerationResult:
        generated = session.committed[len(prompt_ids):]
        reason = ("error" if error else "stop" if stopped else
                  finish_reason(generated, settings.max_new_tokens, info.eos_token_ids))
        return GenerationResult(list(prompt_ids), generated,
                                recorder.finish(len(generated), session.reopens),
                                finish_reason=reason,
                                logprobs=logprobs if settings.logprobs is not None else None)

    pool = (ThreadPoolExecutor(1, thread_name_prefix="specdec-verify")
            if settings.overlap and drafter.overlaps else None)
    ahead: Draft | None = None
    logprobs: list[TokenLogprob] = []
    if constraint is not None or session.config.penalized:
        drafter.shape(session.shape_row)  # its rows as the target's will be
    try:
        session.open()
        recorder.prefilled()
        drafter.reset(prompt_ids, settings.encoder_ids)
        while ((generated := session.position - len(prompt_ids)) < settings.max_new_tokens
               and session.position <= info.max_context):
            room = settings.max_new_tokens - generated
            plan = policy.plan(session.position, room)  # propose the block's shape
            in_flight = _draft_ahead(pool, drafter, plan.k, session.config, generator, room)
            outcome = speculative_block(session, drafter, plan, generator, info,  # verify
                                        drafted=ahead, in_flight=in_flight)
            session.commit(outcome.tokens)  # commit
            drafter.commit(outcome.tokens)
            logprobs.extend(outcome.logprobs or [])
            ahead = in_flight.take(outcome.tokens) if in_flight is not None else None
            recorder.block(outcome.draft_ids, outcome.num_accepted, outcome.drafting_s,
                           outcome.round_trip_s, outcome.verifier_s or 0.0)
            policy.observe(plan, outcome)
            if on_block is not None and on_block(outcome):
                stopped = True
                break
            if outcome.finished:
                break
    except SpecDecError as exc:  # keep what was generated: the caller reports it as partial
        exc.partial = result(error=True)
        raise
    except GrammarDeadEnd as exc:
        refused = GrammarRefused(str(exc))
        refused.partial = result(error=True)
        raise refused from None
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        drafter.shape(None)
        session.close()
    return result()


def _draft_ahead(pool: ThreadPoolExecutor | None, drafter: Drafter, k: int,
                 config: SamplingConfig, generator: torch.Generator,
                 room: int) -> InFlight | None:
    """With overlap, drafting the block after this one while it is verified. The draft ahead
    draws from its own generator, seeded from ours every block whatever happens, so a seed
    gives the same output however the timing falls."""
    if pool is None or k == 0:
        return None
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return InFlight(pool, drafter, k, config, torch.Generator().manual_seed(seed), room=room)
