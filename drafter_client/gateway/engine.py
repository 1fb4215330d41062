"""The engine of ``specdec serve``: OpenAI requests -> generation jobs on worker threads, each on
its own fork of the :class:`SpecDecClient`; plain answers and server-sent event streams.

At most ``max_concurrency`` generations run at once and ``max_waiting`` more wait; beyond that a
429. A stream starts once its first block is verified (a failure before is an ordinary HTTP
error). A client that hangs up, streaming or not, stops its generation at the next block: the
handler watches the connection while it waits (``gone``), and a job whose client left before a
worker took it never starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from pydantic import ValidationError

from drafter_client.api import Penalties, SpecDecClient
from drafter_client.errors import GrammarRefused
from drafter_client.gateway.metrics import GatewayMetrics
from drafter_client.gateway.schema import ChatCompletionRequest, CompletionRequest, OpenAIError
from drafter_client.outcome import BlockOutcome, TokenLogprob
from drafter_client.settings import GatewaySettings
from drafter_client.speculative import GenerationResult
from drafter_client.text import TextTracker
from drafter_client.transport import SpecDecError, VerifierHTTPError, VerifierUnavailable
from shared.http.auth import bearer_token
from shared.protocol.grammar import json_schema_grammar
from shared.protocol.schema import SamplingParams


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stops: list[str]
    # A seed the request chose: the output is the same whatever the cost model's k (which
    # follows timings) - coupled sampling, as ``SpecDecClient.generate(reproducible=True)``.
    reproducible: bool = False
    k: int | str | None = None  # the k policy; None: the client's
    target_alone: bool = False  # plain steps on the verifier, no drafts (a race's reference)
    blocks: bool = False  # describe every verified block (``block_event``)
    prediction: list[int] | None = None  # Predicted Outputs: ids drafted from first
    logprobs: int | None = None  # report the tokens' log-probabilities and this many best
    grammar: str | None = None  # structured output: the grammar every token keeps
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Finished:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens or the context)
    completion_tokens: int
    result: GenerationResult
    blocks: list[dict[str, Any]] | None = None  # every block's event, when the job asked
    logprobs: list[TokenLogprob] | None = None  # one per token of the answer, when asked


# What a worker hands the answer as it goes: a piece of text that can no longer change, the
# verified block it completed (``Job.blocks``; else None), and the log-probabilities of the
# tokens that block added to the answer (``Job.logprobs``; else None).
Emit = Callable[[str, dict[str, Any] | None, list[TokenLogprob] | None], None]


def block_event(index: int, outcome: BlockOutcome, pieces: list[str]) -> dict[str, Any]:
    """One verified block as the stream's ``specdec_block``: its k, how many drafts passed, its
    times, and every token it kept as ``[text, kind]`` (``BlockOutcome.kinds``). A token's text
    is what became final when it arrived, so it may be "" (the start of a character, a possible
    stop string) and a later token's text may hold some of it; together they are the answer's
    text, and text sent after the last block belongs to the last token."""
    return {"index": index, "k": len(outcome.draft_ids), "accepted": outcome.num_accepted,
            "round_trip_ms": round(outcome.round_trip_s * 1e3, 3),
            "verifier_ms": round((outcome.verifier_s or 0.0) * 1e3, 3),
            "drafting_ms": round(outcome.drafting_s * 1e3, 3),
            "tokens": [[piece, kind] for piece, kind
                       in zip(pieces, outcome.kinds()[:len(pieces)], strict=True)]}


# What the chat template adds per message, in characters of work: a chat of many empty
# messages costs the template and the tokenizer as much as a long text does.
TEMPLATE_CHARS_PER_MESSAGE = 32


def tokenize_cost(body: CompletionRequest | ChatCompletionRequest) -> int:
    """The request's tokenizing work in characters: its text (0 for token ids), and for a
    chat :data:`TEMPLATE_CHARS_PER_MESSAGE` more per message."""
    if isinstance(body, ChatCompletionRequest):
        predicted = len(body.prediction.text()) if body.prediction is not None else 0
        return predicted + sum(len(message.text()) + TEMPLATE_CHARS_PER_MESSAGE
                               for message in body.messages)
    prompt = body.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


class Abandoned(Exception):
    """The job's client hung up before a worker took it: nothing was generated."""


# Waits until the HTTP client hangs up (returns then); ``None``: not watched.
Gone = Callable[[], Awaitable[None]] | None


def _verifier_error(exc: SpecDecError) -> OpenAIError:
    """A failed generation as the status an OpenAI client expects."""
    if isinstance(exc, GrammarRefused):
        return OpenAIError(400, f"response_format: {exc}", "response_format",
                           code="grammar_dead_end")
    if isinstance(exc, VerifierUnavailable):
        return OpenAIError(503, f"the verifier is unavailable: {exc}", code="verifier_unavailable",
                           retry_after_s=1)
    if isinstance(exc, VerifierHTTPError):
        if exc.status in (400, 413, 422):  # the verifier refused what this request asked
            return OpenAIError(400, str(exc), exc.field, code=exc.code)
        if exc.status == 429:
            return OpenAIError(429, str(exc), code=exc.code, retry_after_s=1)
    return OpenAIError(502, f"verifier error: {exc}", code="verifier_error")


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the tokenizer's longest vocabulary entry: no token covers more of a text.
    (A byte-level entry has one character per byte, and a decoded byte is at most one
    character; a SentencePiece or word entry is its text.)"""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


# Work up to this many characters (``tokenize_cost``) is tokenized on the event loop (about 1-2
# ms); more on the gateway's tokenizer thread (tokenizers release the GIL: the loop keeps serving).
INLINE_TOKENIZE_CHARS = 8192

# Every character for which str.isspace() is true.
WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
              + "".join(map(chr, range(0x2000, 0x200b))) + "\u2028\u2029\u202f\u205f\u3000")


def visible_chars(text: str) -> int:
    """Characters of ``text`` that are not whitespace (some tokenizers drop whitespace): one
    fast count per whitespace character, no copy of the text."""
    return len(text) - sum(map(text.count, WHITESPACE))


class Gateway:
    def __init__(self, client: SpecDecClient, settings: GatewaySettings) -> None:
        self.client, self.settings = client, settings
        # A prompt with more non-whitespace characters than this has at least max_context
        # tokens (no token covers more than the longest entry's characters), so it is refused
        # before the tokenizer spends time and memory on it; below it the exact count decides.
        self.token_chars = longest_token_chars(client.tokenizer)
        self.max_prompt_chars = self.token_chars * client.info.max_context
        self.metrics = GatewayMetrics()
        self.executor = ThreadPoolExecutor(settings.max_concurrency,
                                           thread_name_prefix="generation")
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0
        self._tokenizing = 0  # long prompts on the tokenizer thread or waiting for it

    # -- requests -> jobs ------------------------------------------------------------------
    async def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> Job:
        """The request's job. A long prompt is tokenized off the event loop, on the tokenizer
        thread, with at most ``max_tokenizing`` long prompts there at once (else 429); so is
        every grammar compiled (``response_format``), whatever its size."""
        make = self.chat_job if isinstance(body, ChatCompletionRequest) else self.completion_job
        compiles = isinstance(body, ChatCompletionRequest) and body.output_schema()[0]
        if tokenize_cost(body) <= INLINE_TOKENIZE_CHARS and not compiles:
            return make(body)  # type: ignore[arg-type]
        with self._lock:
            if self._tokenizing >= self.settings.max_tokenizing:
                raise OpenAIError(429, f"the gateway is tokenizing {self._tokenizing} long "
                                  "prompts, its limit; retry later", code="too_many_requests",
                                  retry_after_s=1)
            self._tokenizing += 1
        try:
            return await asyncio.wrap_future(self.tokenizer_thread.submit(make, body))  # type: ignore[arg-type]
        finally:
            with self._lock:
                self._tokenizing -= 1

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        presented = bearer_token(request.headers.get("authorization", "")) or ""
        if not hmac.compare_digest(presented.encode(), key.encode()):
            raise OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                              code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist (this server serves "
                              f"`{self.settings.served_model_name}`)", "model",
                              code="model_not_found")

    def job(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
            prompt_param: str, default_max_tokens: int | None) -> Job:
        info = self.client.info
        if len(prompt_ids) >= info.max_context:
            raise OpenAIError(400, f"this model's maximum context length is {info.max_context} "
                              f"tokens; the prompt has {len(prompt_ids)}", prompt_param,
                              code="context_length_exceeded")
        if any(not 0 <= t < info.vocab_size for t in prompt_ids):
            raise OpenAIError(400, f"prompt token ids must lie in [0, {info.vocab_size})",
                              prompt_param)
        try:
            sampling = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=max(body.top_k or 0, 0), top_p=1.0 if body.top_p is None else body.top_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=body.bias_pairs(info.vocab_size))
        except ValidationError as exc:
            error = exc.errors()[0]
            raise OpenAIError(400, error["msg"], str(error["loc"][0])) from None
        # No max_tokens on a chat: up to the context limit (what the session can still hold).
        max_tokens = body.max_tokens or default_max_tokens or info.max_context - len(prompt_ids)
        seed = secrets.randbits(62) if body.seed is None else body.seed % 2**63
        options = body.specdec
        if isinstance(options.k, int) and options.k > info.max_draft_tokens:
            raise OpenAIError(400, f"specdec.k must be in [0, {info.max_draft_tokens}] (the "
                              f"verifier's max_draft_tokens); got {options.k}", "specdec.k")
        return Job(prompt_ids, max_tokens, sampling, seed, body.stop_list(),
                   reproducible=body.seed is not None, k=options.k,
                   target_alone=options.target_alone, blocks=options.blocks,
                   logprobs=body.logprobs_asked())

    @staticmethod
    def choices(job: Job, n: int) -> list[Job]:
        """A request's ``n`` choices: choice i's seed is the request's plus i (a seeded request
        gives the same n answers again), else a fresh seed each."""
        return [job, *(dataclasses.replace(
            job, seed=(job.seed + i) % 2**63 if job.reproducible else secrets.randbits(62),
            cancelled=threading.Event()) for i in range(1, n))]

    def check_text_length(self, texts: list[str], param: str) -> None:
        """A 400 for text that surely exceeds the context, decided without tokenizing it."""
        if sum(map(len, texts)) <= self.max_prompt_chars:
            return  # the exact count decides
        chars = sum(visible_chars(text) for text in texts)
        if chars > self.max_prompt_chars:
            raise OpenAIError(400, f"this model's maximum context length is "
                              f"{self.client.info.max_context} tokens; the text's {chars} "
                              f"non-space characters make at least {chars // self.token_chars} "
                              "tokens", param, code="context_length_exceeded")

    def completion_job(self, body: CompletionRequest) -> Job:
        body.check_supported()
        self.check_model(body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            self.check_text_length([prompt], "prompt")
        ids = prompt if isinstance(prompt, list) else self.client.encode(prompt)
        return self.job(body, ids, "prompt", self.settings.completion_max_tokens)

    def chat_job(self, body: ChatCompletionRequest) -> Job:
        body.check_supported()
        self.check_model(body.model)
        self.check_text_length([message.text() for message in body.messages], "messages")
        try:
            ids = self.client.encode_chat(body.conversation(), self.settings.chat_template)
        except SpecDecError as exc:
            raise OpenAIError(400, str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template that fails on these messages
            raise OpenAIError(400, f"the chat template failed on these messages: {exc}",
                              "messages") from None
        job = self.job(body, ids, "messages", None)
        constrained, schema = body.output_schema()
        if constrained:
            job.grammar = self.grammar(schema)
        if body.prediction is not None:
            job.prediction = self.prediction_ids(body.prediction.text())
        return job

    def grammar(self, schema: dict[str, Any] | None) -> str:
        """The grammar of a JSON schema (None: any JSON object), compiled for this tokenizer
        once here so that a schema the engine refuses is a 400, not a failed generation."""
        try:
            grammar = json_schema_grammar(schema)
            self.client.constraint(grammar)
        except (ValueError, SpecDecError) as exc:
            raise OpenAIError(400, f"response_format: {exc}", "response_format") from None
        return grammar

    def prediction_ids(self, text: str) -> list[int]:
        """A prediction's ids; one as long as the context is refused (it could never be
        repeated whole) before it is tokenized where its length says so."""
        self.check_text_length([text], "prediction")
        ids = self.client.prediction_ids(text)
        if len(ids) >= self.client.info.max_context:
            raise OpenAIError(400, f"the prediction has {len(ids)} tokens; this model's "
                              f"maximum context length is {self.client.info.max_context}",
                              "prediction", code="context_length_exceeded")
        return ids

    # -- running -----------------------------------------------------------------------------
    def admit(self, count: int = 1) -> None:
        """Room for ``count`` generations (a request's choices), or a 429."""
        with self._lock:
            limit = self.settings.max_concurrency + self.settings.max_waiting
            if self._admitted + count > limit:
                raise OpenAIError(429, f"the gateway is at its limit of {limit} generations "
                                  f"({self._admitted} admitted, this request asks "
                                  f"{count}); retry later",
                                  code="too_many_requests", retry_after_s=1)
            self._admitted += count
            self.metrics.waiting.set(self._admitted - self._running)

    def _started(self, delta: int) -> None:
        with self._lock:
            self._running += delta
            if delta < 0:
                self._admitted -= 1
            self.metrics.running.set(self._running)
            self.metrics.waiting.set(self._admitted - self._running)

    def generate(self, job: Job, emit: Emit | None) -> Finished:
        """Worker thread: one generation. ``emit`` gets every piece of text as soon as it can
        no longer change ("" once, after the first block, so a stream can start), with the
        block it completed when the job asked for blocks."""
        self._started(+1)
        try:
            return self._generate(job, emit)
        finally:
            self._started(-1)

    def _generate(self, job: Job, emit: Emit | None) -> Finished:
        if job.cancelled.is_set():
            raise Abandoned
        admitted = time.perf_counter()
        client = self.client.fork()
        tracker = TextTracker(client.decode, job.stops)
        blocks: list[dict[str, Any]] = []
        logprobs: list[TokenLogprob] = []
        verified = 0

        def on_block(outcome: BlockOutcome) -> bool:
            nonlocal verified
            first, verified = verified == 0, verified + 1
            if first:
                self.metrics.first_token.observe(time.perf_counter() - admitted)
            kept = len(tracker.ids)
            if job.blocks:  # token by token: each token's own piece of the text
                pieces = []
                for token in outcome.tokens:
                    if tracker.stopped:
                        break
                    tracker.add([token])
                    pieces.append(tracker.delta())
                piece, block = "".join(pieces), block_event(len(blocks), outcome, pieces)
                blocks.append(block)
            else:
                tracker.add(outcome.tokens)
                piece, block = tracker.delta(), None
            added = (outcome.logprobs or [])[:max(len(tracker.ids) - kept, 0)]  # the answer's
            logprobs.extend(added)
            if emit is not None and (piece or first or block is not None or added):
                emit(piece, block, added if job.logprobs is not None else None)
            return tracker.stopped or job.cancelled.is_set()

        sampling = job.sampling
        penalties = Penalties(sampling.presence_penalty, sampling.frequency_penalty,
                              dict(sampling.logit_bias))
        try:
            if job.target_alone:  # plain steps through a session, in runs: no drafts at all
                result = client.generate(
                    job.prompt_ids, num_draft_tokens=0, max_new_tokens=job.max_tokens,
                    temperature=job.sampling.temperature, top_k=job.sampling.top_k,
                    top_p=job.sampling.top_p, seed=job.seed, reproducible=job.reproducible,
                    on_block=on_block, logprobs=job.logprobs, penalties=penalties,
                    grammar=job.grammar)
            else:
                result = client.generate(
                    job.prompt_ids, num_draft_tokens=job.k,  # None: the client's settings
                    max_new_tokens=job.max_tokens, temperature=job.sampling.temperature,
                    top_k=job.sampling.top_k, top_p=job.sampling.top_p, seed=job.seed,
                    reproducible=job.reproducible, on_block=on_block,
                    prediction=job.prediction, logprobs=job.logprobs, penalties=penalties,
                    grammar=job.grammar)
        finally:
            client.close()
        tail = tracker.delta(final=True)  # what was held back: an incomplete character at the end
        if emit is not None and tail:
            emit(tail, None, None)
        self.metrics.finished(len(job.prompt_ids), result)
        finish = "stop" if tracker.stopped or result.finish_reason == "stop" else "length"
        return Finished(tracker.text, finish, len(tracker.ids), result,
                        blocks if job.blocks else None,
                        logprobs if job.logprobs is not None else None)

    async def run(self, jobs: list[Job], gone: Gone = None) -> list[Finished]:
        """The request's choices (``n`` jobs, run side by side), each finished."""
        self.admit(len(jobs))
        works = [asyncio.wrap_future(self.executor.submit(self.generate, job, None))
                 for job in jobs]
        try:
            done = await _unless_gone(asyncio.gather(*works, return_exceptions=True), gone)
        finally:
            _cancel(jobs)  # the caller went away: stop at the next block
        for result in done:
            if isinstance(result, SpecDecError):
                raise _verifier_error(result) from None
            if isinstance(result, BaseException):
                raise result
        return done  # type: ignore[no-any-return]

    async def stream(self, jobs: list[Job], chunk: Chunk,
                     usage_chunk: Callable[[list[Finished]], dict[str, Any] | None],
                     first: Callable[[int], dict[str, Any]] | None = None,
                     gone: Gone = None) -> AsyncIterator[bytes]:
        """Start the request's choices (``n`` jobs, side by side); once a first block is
        verified (or a choice failed, which is then an ordinary HTTP error) return the SSE body:
        ``first`` per choice, one chunk per piece of text (with its choice's index), a last
        chunk per choice with its finish reason and metrics, usage when asked, ``[DONE]``."""
        self.admit(len(jobs))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

        def start(index: int, job: Job) -> None:
            def emit(piece: str, block: dict[str, Any] | None,
                     logprobs: list[TokenLogprob] | None) -> None:
                loop.call_soon_threadsafe(queue.put_nowait,
                                          (index, "text", (piece, block, logprobs)))

            future: Future[Finished] = self.executor.submit(self.generate, job, emit)
            future.add_done_callback(
                lambda f: loop.call_soon_threadsafe(queue.put_nowait, (index, "done", f)))

        for index, job in enumerate(jobs):
            start(index, job)
        getter = asyncio.ensure_future(queue.get())
        try:
            item = await _unless_gone(getter, gone)
        except BaseException:
            getter.cancel()
            _cancel(jobs)
            raise
        _, kind, value = item
        if kind == "done" and value.exception() is not None:
            _cancel(jobs)
            exc = value.exception()
            raise _verifier_error(exc) if isinstance(exc, SpecDecError) else exc
        return self._events(jobs, queue, item, chunk, usage_chunk, first)

    async def _events(self, jobs: list[Job], queue: asyncio.Queue[tuple[int, str, Any]],
                      item: tuple[int, str, Any], chunk: Chunk,
                      usage_chunk: Callable[[list[Finished]], dict[str, Any] | None],
                      first: Callable[[int], dict[str, Any]] | None) -> AsyncIterator[bytes]:
        finished: dict[int, Finished] = {}
        try:
            if first is not None:
                for index in range(len(jobs)):
                    yield _sse(first(index))
            while True:
                index, kind, value = item
                if kind == "text":
                    piece, block, logprobs = value
                    if piece or block is not None or logprobs:
                        event = chunk(index, piece, None, logprobs)
                        if block is not None:
                            event["specdec_block"] = block
                        yield _sse(event)
                else:
                    exc = value.exception()
                    if exc is not None:
                        error = (_verifier_error(exc) if isinstance(exc, SpecDecError)
                                 else OpenAIError(500, f"internal error: {exc}"))
                        yield _sse(error.body())
                        break
                    done: Finished = value.result()
                    finished[index] = done
                    last = chunk(index, "", done.finish_reason, None)
                    last["specdec"] = done.result.metrics.to_dict()
                    yield _sse(last)
                    if len(finished) == len(jobs):
                        usage = usage_chunk([finished[i] for i in range(len(jobs))])
                        if usage is not None:
                            yield _sse(usage)
                        break
                item = await queue.get()
            yield b"data: [DONE]\n\n"
        finally:
            _cancel(jobs)  # a client that hung up stops the generations at their next block


# A stream chunk: (choice index, text, finish reason or None, the log-probabilities of the
# tokens it adds or None) -> the event's payload.
Chunk = Callable[[int, str, str | None, list[TokenLogprob] | None], dict[str, Any]]


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancelled.set()


class ClientGone(Exception):
    """The HTTP client hung up while its answer was being made; nobody reads a reply."""


async def _unless_gone(work: asyncio.Future[Any], gone: Gone) -> Any:
    """``work``'s result; :class:`ClientGone` as soon as the client hangs up first (``work``
    then goes on to its end unobserved: the caller cancels the job)."""
    if gone is None:
        return await work
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.add_done_callback(_observe)
        raise ClientGone
    return work.result()


def _observe(future: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned future's outcome, so asyncio does not log it as never read."""
    if not future.cancelled():
        future.exception()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
