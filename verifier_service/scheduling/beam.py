"""Beam search on the verifier: the target-alone quality baseline people compare with.

The search follows transformers' ``generate(num_beams=N, do_sample=False, length_penalty,
early_stopping, no_repeat_ngram_size)`` step for step, so the output is the same token for token:

* each step scores every running beam's next token: log_softmax of the logits plus the beam's
  running score; the best ``K = max(2, 1 + #eos) * N`` continuations over all beams are kept;
* a continuation that ends in EOS or reaches the length limit is a finished hypothesis with
  score ``sum of log-probs / generated_length ** length_penalty`` - only if it ranks among the
  top N of the K - and competes for the N finished slots; the best N continuations that did not
  finish are the next running beams;
* the search ends when no running beam can beat the worst finished one (the bound depends on
  ``early_stopping``: ``True`` stops once N hypotheses are finished, ``False`` bounds with the
  current length, ``"never"`` with the longest possible length when the penalty favours length),
  or when every continuation finished; the answer is the best finished hypothesis.

:class:`BeamSearch` is the math on [N, vocab] logits; :func:`beam_generate` runs it on the
verifier: every beam has a KV slot, each step's N one-token forwards go through the scheduler as
ordinary jobs (so they batch with other clients' work and the server stays responsive), and
after each step the slots are re-ordered to follow their parents (a copy of the parent's rows).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engines.target import Engine, ForwardItem, Step, StepResult
from shared.protocol.schema import GenerateRequest, GenerateResponse
from verifier_service.errors import VerifierError
from verifier_service.scheduling.jobs import JobContext
from verifier_service.scheduling.scheduler import Scheduler
from verifier_service.scheduling.sessions import busy_error

NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class BeamSearch:
    """One prompt's beam search state (batch of one). ``step`` takes the running beams' logits
    and says which beams continue from which parents with which tokens."""

    prompt: list[int]
    num_beams: int
    max_length: int  # prompt + generated tokens, at most
    eos_ids: list[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    running: torch.Tensor = field(init=False)  # [N, max_length] token ids
    running_scores: torch.Tensor = field(init=False)  # [N] float32
    finished: torch.Tensor = field(init=False)  # [N, max_length]
    finished_scores: torch.Tensor = field(init=False)  # [N]
    finished_lengths: torch.Tensor = field(init=False)  # [N] generated tokens of each
    is_finished: torch.Tensor = field(init=False)  # [N] bool
    improvable: bool = True
    cur_len: int = 0

    def __post_init__(self) -> None:
        n, fill = self.num_beams, self.eos_ids[0] if self.eos_ids else 0
        self.cur_len = len(self.prompt)
        self.running = torch.full((n, self.max_length), fill, dtype=torch.long)
        self.running[:, :self.cur_len] = torch.tensor(self.prompt)
        self.running_scores = torch.zeros(n, dtype=torch.float32)
        self.running_scores[1:] = NEG  # at first every beam is the prompt: expand one of them
        self.finished = self.running.clone()
        self.finished_scores = torch.full((n,), NEG, dtype=torch.float32)
        self.finished_lengths = torch.zeros(n, dtype=torch.long)
        self.is_finished = torch.zeros(n, dtype=torch.bool)
        self.keep = max(2, 1 + len(self.eos_ids)) * n  # candidates kept per step
        self.eos = torch.tensor(self.eos_ids, dtype=torch.long)

    def _ban_repeats(self, log_probs: torch.Tensor) -> None:
        """no_repeat_ngram_size: a token that would complete an n-gram the beam already holds
        gets -inf (prompt included)."""
        n = self.no_repeat_ngram_size
        if n <= 0 or self.cur_len + 1 < n:
            return
        for beam in range(self.num_beams):
            seq = self.running[beam, :self.cur_len].tolist()
            prefix = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
            banned = {seq[i + n - 1] for i in range(len(seq) - n + 1)
                      if tuple(seq[i:i + n - 1]) == prefix}
            if banned:
                log_probs[beam, list(banned)] = float("-inf")

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """``logits``: [N, vocab] for the running beams. Returns (parents, tokens, done): the
        next running beam j continues beam ``parents[j]`` with ``tokens[j]``."""
        n, cur, prompt_len = self.num_beams, self.cur_len, len(self.prompt)
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
        self._ban_repeats(log_probs)
        vocab = log_probs.shape[-1]
        total = (log_probs + self.running_scores[:, None]).reshape(1, -1)  # [1, N * vocab]
        top_scores, top_index = torch.topk(total, k=self.keep)  # [1, K]
        top_scores, top_index = top_scores[0], top_index[0]
        beams, tokens = top_index // vocab, top_index % vocab  # [K]
        candidates = self.running[beams].clone()  # [K, max_length]
        candidates[:, cur] = tokens
        hits = torch.isin(tokens, self.eos) | (cur + 1 >= self.max_length)  # [K]

        # The next running beams: the best N continuations that did not finish.
        running_scores = top_scores + hits.to(torch.float32) * NEG
        chosen = torch.topk(running_scores, k=n)[1]  # [N]
        self.running = candidates[chosen]
        self.running_scores = running_scores[chosen]
        parents = beams[chosen]

        # Finished hypotheses: only the top N of the K may enter, scored with the penalty.
        top_n = torch.zeros(self.keep, dtype=torch.bool)
        top_n[:n] = True
        just_finished = hits & top_n
        scores = top_scores / ((cur + 1 - prompt_len) ** self.length_penalty)
        full = bool(self.is_finished.all()) and self.early_stopping is True
        scores = scores + float(full) * NEG
        scores = scores + float(not self.improvable) * NEG
        scores = scores + (~just_finished) * NEG
        merged_scores = torch.cat((self.finished_scores, scores))
        best = torch.topk(merged_scores, k=n)[1]  # [N]
        self.finished = torch.cat((self.finished, candidates))[best]
        self.finished_scores = merged_scores[best]
        lengths = torch.full((self.keep,), cur + 1 - prompt_len, dtype=torch.long)
        self.finished_lengths = torch.cat((self.finished_lengths, lengths))[best]
        self.is_finished = torch.cat((self.is_finished, just_finished))[best]

        self.cur_len = cur = cur + 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - prompt_len
        else:
            best_length = cur - prompt_len
        best_running = self.running_scores[:1] / (best_length ** self.length_penalty)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(),
                                     torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_running > worst_finished).any())
        done = not (self.improvable
                    and not (bool(self.is_finished.all()) and self.early_stopping is True)
                    and not bool(hits.all()))
        return parents.tolist(), self.running[:, cur - 1].tolist(), done

    def result(self) -> list[int]:
        """The best finished hypothesis' generated tokens (its EOS included)."""
        start = len(self.prompt)
        return self.finished[0, start:start + int(self.finished_lengths[0])].tolist()


@dataclass
class BeamForwardJob:
    """One beam's new token on top of its slot (an ordinary scheduler job)."""

    slot: int
    start: int  # cached positions before the token
    tokens: list[int]
    key: Hashable
    keep_logits: bool = True
    encoder_ids: list[int] | None = None  # encoder-decoder targets: the first job's source
    kind = "beam"

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def session_key(self) -> Hashable:
        return self.key

    def prepare(self, busy: set[Any]) -> Step:
        # no block to decide: beam search reads the whole row on the host
        return Step(ForwardItem(self.slot, self.start, self.tokens, self.keep_logits,
                                self.encoder_ids))

    def finish(self, result: StepResult) -> torch.Tensor | None:
        return None if result.rows is None else result.rows[-1]  # [vocab]

    def abort(self) -> None:
        pass


def _claim(ctx: JobContext, owner: str | None, count: int, tokens: int) -> list[int]:
    """Model thread: ``count`` KV slots, the first holding ``tokens`` (the prompt). A search
    takes free slots and may evict only its own key's sessions, never another client's."""
    slots: list[int] = []
    try:
        for _ in range(count):
            slots.append(ctx.claim_slot(owner, set(), own_only=True))
        ctx.hold(slots[0], tokens, owner, set(), own_only=True)
    except VerifierError:
        for slot in slots:
            ctx.engine.release(slot)
        raise busy_error(f"beam search needs {count} KV slots") from None
    return slots


def check_beam_request(req: GenerateRequest) -> None:
    if req.num_beams == 1:
        if req.no_repeat_ngram_size or req.length_penalty != 1.0 or req.early_stopping:
            raise VerifierError(422, "beam_options_without_beams", "length_penalty, "
                                "early_stopping and no_repeat_ngram_size need num_beams > 1",
                                "num_beams")
        return
    if req.grammar is not None:
        raise VerifierError(422, "beam_search_grammar", "beam search takes no grammar",
                            "grammar")
    if req.logprobs is not None:
        raise VerifierError(422, "beam_search_logprobs", "logprobs are not reported for beam "
                            "search", "logprobs")
    if req.sampling.temperature != 0.0:
        raise VerifierError(422, "beam_search_is_greedy", "num_beams > 1 is beam search, which "
                            "is greedy here: send temperature 0", "num_beams")
    if not req.stop_at_eos:
        raise VerifierError(422, "beam_search_stops_at_eos", "beam search ends hypotheses at "
                            "EOS: stop_at_eos must be true", "stop_at_eos")


async def beam_generate(ctx: JobContext, scheduler: Scheduler, req: GenerateRequest,
                        eos_token_ids: list[int], owner: str | None = None) -> GenerateResponse:
    prompt, n = req.prompt_ids, req.num_beams
    new_tokens = min(req.max_new_tokens, ctx.validator.max_context - len(prompt) + 1)
    search = BeamSearch(prompt, n, len(prompt) + new_tokens, eos_token_ids,
                        req.length_penalty, req.early_stopping, req.no_repeat_ngram_size)
    # Every beam holds a KV slot as a session does: each counts against the key's quota,
    # and against max_sessions, until the search ends.
    ctx.sessions.reserve(owner, n)
    try:
        slots = await scheduler.run(_claim, ctx, owner, n, len(prompt))
    except BaseException:
        ctx.sessions.unreserve(owner, n)
        raise
    tag = f"beam-{secrets.token_hex(6)}"
    keys = [(owner, f"{tag}-{j}") for j in range(n)]
    started, calls = time.perf_counter(), 0
    try:
        # The prompt once, into beam 0's slot: at first every beam is the prompt.
        encoder_ids = req.encoder_ids
        if len(prompt) > 1:
            await scheduler.submit(BeamForwardJob(slots[0], 0, prompt[:-1], keys[0],
                                                  keep_logits=False, encoder_ids=encoder_ids))
            encoder_ids = None
        row = await scheduler.submit(BeamForwardJob(slots[0], len(prompt) - 1, prompt[-1:],
                                                    keys[0], encoder_ids=encoder_ids))
        calls += 1
        logits = row[None].expand(n, -1)  # [N, vocab]
        while True:
            parents, tokens, done = search.step(logits)
            if done:
                break
            # every beam's slot holds its parent's cache, then scores its new token
            cached = search.cur_len - 1
            await scheduler.run(_follow, ctx, owner, slots, parents, cached)
            rows = await asyncio.gather(*(
                scheduler.submit(BeamForwardJob(slots[j], cached, [tokens[j]], keys[j]))
                for j in range(n)))
            calls += 1
            logits = torch.stack(rows)
    finally:
        for key in keys:
            scheduler.forget(key)
        try:
            await scheduler.run(_release, ctx.engine, slots)
        finally:
            ctx.sessions.unreserve(owner, n)
    return GenerateResponse(token_ids=search.result(),
                            forward_ms=1e3 * (time.perf_counter() - started), forward_calls=calls)


def _follow(ctx: JobContext, owner: str | None, slots: list[int], parents: list[int],
            cached: int) -> None:
    """Model thread: every beam's slot holds its parent's ``cached`` tokens and room for one
    more (evicting sessions by the store's policy if a region must grow)."""
    for slot in slots:
        ctx.hold(slot, cached + 1, owner, set(), own_only=True)
    ctx.engine.reorder(slots, parents, cached)


def _release(engine: Engine, slots: list[int]) -> None:
    for slot in slots:
        engine.release(slot)
