"""``specdec serve``: an OpenAI-compatible server on the client side.

It holds the drafter next to the application and forwards to a verifier URL, so any OpenAI client
(the ``openai`` package, LangChain, chat UIs) gets speculative decoding with the target's exact
distribution. Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Each request is one generation on its own fork of the :class:`SpecDecClient` (its own drafter
state and verifier session; the drafter's weights are shared), run on a worker thread; at most
``max_concurrency`` run at once and ``max_waiting`` more wait, beyond that a 429. The verifier
batches the sessions of concurrent requests into its forwards. ``stream: true`` answers with
server-sent events in OpenAI's chunk format, one chunk per verified block. The speculative
metrics ride in an extra ``specdec`` field that OpenAI clients ignore.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from drafter_client.api import SpecDecClient
from drafter_client.metrics import GenerationMetrics
from drafter_client.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from drafter_client.speculative import BlockOutcome, GenerationResult
from drafter_client.text import TextTracker
from drafter_client.transport import SpecDecError, VerifierHTTPError, VerifierUnavailable
from shared.http_metrics import LATENCY_BUCKETS, HttpMetrics, RequestMetrics
from shared.schema import SamplingParams


@dataclass(frozen=True)
class GatewaySettings:
    served_model_name: str
    num_draft_tokens: str = "4"  # k: an integer, "auto" or "heuristic"
    max_concurrency: int = 8  # generations running at once (worker threads)
    max_waiting: int = 64  # admitted requests waiting for a worker; beyond: 429
    chat_template: str | None = None  # overrides the tokenizer's
    api_key: str | None = None  # clients must send it as a Bearer token
    completion_max_tokens: int = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stops: list[str]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Finished:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens or the context)
    completion_tokens: int
    result: GenerationResult


class GatewayMetrics:
    """The gateway's Prometheus metrics (client side of the split)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.http = HttpMetrics("specdec_gateway", r)
        p = "specdec_gateway"
        self.running = Gauge(f"{p}_requests_running", "Generations running", registry=r)
        self.waiting = Gauge(f"{p}_requests_waiting", "Admitted generations waiting for a "
                             "worker", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens", registry=r)
        self.generated_tokens = Counter(f"{p}_generated_tokens", "Tokens generated",
                                        registry=r)
        self.verify_calls = Counter(f"{p}_verify_calls", "Verify round trips", registry=r)
        self.drafts = Counter(f"{p}_drafts", "Verify calls that proposed at least one token",
                              registry=r)
        self.drafted = Counter(f"{p}_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter(f"{p}_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_at = Counter(f"{p}_accepted_at_position", "Drafts whose token at this "
                                   "position (1-based) was accepted; / drafts = vLLM's "
                                   "per-position acceptance", ["position"], registry=r)
        self.retries = Counter(f"{p}_verifier_retries", "Verifier calls repeated after a "
                               "connection error, 429 or 502-504", registry=r)
        self.reopens = Counter(f"{p}_session_reopens", "Verifier sessions reopened after the "
                               "verifier lost one", registry=r)
        self.round_trip = Histogram(f"{p}_verify_round_trip_seconds", "One verify round trip",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram(f"{p}_time_to_first_token_seconds", "From admission to "
                                     "the first verified block", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.tokens_per_s = Histogram(f"{p}_tokens_per_second", "Generated tokens per second "
                                      "of one request", buckets=(1, 2, 5, 10, 20, 50, 100, 200,
                                                                 500, 1000, 2000),
                                      registry=r)

        # Lifetime ratios as gauges, for dashboards without PromQL (rate() the counters for
        # a window).
        self._totals = GenerationMetrics()
        self._lock = threading.Lock()
        r.register(_RatioCollector(self))

    def ratios(self) -> tuple[float, list[float]]:
        with self._lock:
            t = self._totals
            rate = t.accepted_tokens / t.drafted_tokens if t.drafted_tokens else 0.0
            return rate, t.per_position_acceptance()

    def finished(self, prompt_tokens: int, result: GenerationResult) -> None:
        m = result.metrics
        with self._lock:
            t = self._totals
            t.drafts += m.drafts
            t.drafted_tokens += m.drafted_tokens
            t.accepted_tokens += m.accepted_tokens
            t.accepted_at += [0] * (len(m.accepted_at) - len(t.accepted_at))
            for i, times in enumerate(m.accepted_at):
                t.accepted_at[i] += times
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(len(result.token_ids))
        self.verify_calls.inc(m.verify_calls)
        self.drafts.inc(m.drafts)
        self.drafted.inc(m.drafted_tokens)
        self.accepted.inc(m.accepted_tokens)
        for i, times in enumerate(m.accepted_at):
            self.accepted_at.labels(str(i + 1)).inc(times)
        self.retries.inc(m.retries)
        self.reopens.inc(m.session_reopens)
        for seconds in m.verify_latencies_s:
            self.round_trip.observe(seconds)
        if m.wall_s > 0 and result.token_ids:
            self.tokens_per_s.observe(len(result.token_ids) / m.wall_s)


class _RatioCollector:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rate, per_position = self.metrics.ratios()
        yield GaugeMetricFamily("specdec_gateway_acceptance_rate", "Accepted / drafted tokens "
                                "since start", value=rate)
        family = GaugeMetricFamily("specdec_gateway_per_position_acceptance", "vLLM's "
                                   "per-position acceptance since start: drafts whose token at "
                                   "this position was accepted / drafts", labels=["position"])
        for i, value in enumerate(per_position):
            family.add_metric([str(i + 1)], value)
        yield family


def _verifier_error(exc: SpecDecError) -> OpenAIError:
    """A failed generation as the status an OpenAI client expects."""
    if isinstance(exc, VerifierUnavailable):
        return OpenAIError(503, f"the verifier is unavailable: {exc}", code="verifier_unavailable",
                           retry_after_s=1)
    if isinstance(exc, VerifierHTTPError):
        if exc.status in (400, 413, 422):  # the verifier refused what this request asked
            return OpenAIError(400, str(exc), exc.field, code=exc.code)
        if exc.status == 429:
            return OpenAIError(429, str(exc), code=exc.code, retry_after_s=1)
    return OpenAIError(502, f"verifier error: {exc}", code="verifier_error")


class Gateway:
    def __init__(self, client: SpecDecClient, settings: GatewaySettings) -> None:
        self.client, self.settings = client, settings
        self.metrics = GatewayMetrics()
        self.executor = ThreadPoolExecutor(settings.max_concurrency,
                                           thread_name_prefix="generation")
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0

    # -- requests -> jobs ------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
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
        if any(not 0 <= t < info.vocab_size for t in prompt_ids):
            raise OpenAIError(400, f"prompt token ids must lie in [0, {info.vocab_size})",
                              prompt_param)
        if len(prompt_ids) >= info.max_context:
            raise OpenAIError(400, f"this model's maximum context length is {info.max_context} "
                              f"tokens; the prompt has {len(prompt_ids)}", prompt_param,
                              code="context_length_exceeded")
        try:
            sampling = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=max(body.top_k or 0, 0), top_p=1.0 if body.top_p is None else body.top_p)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise OpenAIError(400, error["msg"], str(error["loc"][0])) from None
        # No max_tokens on a chat: up to the context limit (the loop stops there).
        max_tokens = body.max_tokens or default_max_tokens or info.max_context
        seed = secrets.randbits(62) if body.seed is None else body.seed % 2**63
        return Job(prompt_ids, max_tokens, sampling, seed, body.stop_list())

    def completion_job(self, body: CompletionRequest) -> Job:
        body.check_supported()
        self.check_model(body.model)
        prompt = body.single_prompt()
        ids = prompt if isinstance(prompt, list) else self.client.encode(prompt)
        return self.job(body, ids, "prompt", self.settings.completion_max_tokens)

    def chat_job(self, body: ChatCompletionRequest) -> Job:
        body.check_supported()
        self.check_model(body.model)
        try:
            ids = self.client.encode_chat(body.conversation(), self.settings.chat_template)
        except SpecDecError as exc:
            raise OpenAIError(400, str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template that fails on these messages
            raise OpenAIError(400, f"the chat template failed on these messages: {exc}",
                              "messages") from None
        return self.job(body, ids, "messages", None)

    # -- running -----------------------------------------------------------------------------
    def admit(self) -> None:
        with self._lock:
            if self._admitted >= self.settings.max_concurrency + self.settings.max_waiting:
                raise OpenAIError(429, f"the gateway is at its limit of "
                                  f"{self._admitted} requests; retry later",
                                  code="too_many_requests", retry_after_s=1)
            self._admitted += 1
            self.metrics.waiting.set(self._admitted - self._running)

    def _started(self, delta: int) -> None:
        with self._lock:
            self._running += delta
            if delta < 0:
                self._admitted -= 1
            self.metrics.running.set(self._running)
            self.metrics.waiting.set(self._admitted - self._running)

    def generate(self, job: Job, emit: Callable[[str], None] | None) -> Finished:
        """Worker thread: one generation. ``emit`` gets every piece of text as soon as it can
        no longer change ("" once, after the first block, so a stream can start)."""
        self._started(+1)
        try:
            return self._generate(job, emit)
        finally:
            self._started(-1)

    def _generate(self, job: Job, emit: Callable[[str], None] | None) -> Finished:
        admitted = time.perf_counter()
        client = self.client.fork()
        tracker = TextTracker(client.decode, job.stops)
        first = True

        def on_block(outcome: BlockOutcome) -> bool:
            nonlocal first
            tracker.add(outcome.tokens)
            piece = tracker.delta()
            if first:
                self.metrics.first_token.observe(time.perf_counter() - admitted)
            if emit is not None and (piece or first):
                emit(piece)
            first = False
            return tracker.stopped or job.cancelled.is_set()

        try:
            result = client.generate(
                job.prompt_ids, num_draft_tokens=self.settings.num_draft_tokens,
                max_new_tokens=job.max_tokens, temperature=job.sampling.temperature,
                top_k=job.sampling.top_k, top_p=job.sampling.top_p, seed=job.seed,
                on_block=on_block)
        finally:
            client.close()
        self.metrics.finished(len(job.prompt_ids), result)
        finish = "stop" if tracker.stopped or result.finish_reason == "stop" else "length"
        return Finished(tracker.text, finish, len(tracker.ids), result)

    async def run(self, job: Job) -> Finished:
        self.admit()
        try:
            return await asyncio.wrap_future(self.executor.submit(self.generate, job, None))
        except SpecDecError as exc:
            raise _verifier_error(exc) from None
        finally:
            job.cancelled.set()  # the caller went away: stop at the next block

    async def stream(self, job: Job, chunk: Callable[[str, str | None], dict[str, Any]],
                     usage_chunk: Callable[[Finished], dict[str, Any] | None],
                     first: dict[str, Any] | None = None) -> AsyncIterator[bytes]:
        """Start the generation; once its first block is verified (or it failed, which is then
        an ordinary HTTP error) return the SSE body: ``first``, one chunk per piece of text, a
        last chunk with the finish reason and the metrics, usage when asked, ``[DONE]``."""
        self.admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def emit(piece: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))

        future: Future[Finished] = self.executor.submit(self.generate, job, emit)
        future.add_done_callback(
            lambda f: loop.call_soon_threadsafe(queue.put_nowait, ("done", f)))
        try:
            kind, value = await queue.get()
        except BaseException:
            job.cancelled.set()
            raise
        if kind == "done" and value.exception() is not None:
            exc = value.exception()
            raise _verifier_error(exc) if isinstance(exc, SpecDecError) else exc
        return self._events(job, queue, (kind, value), chunk, usage_chunk, first)

    async def _events(self, job: Job, queue: asyncio.Queue[tuple[str, Any]],
                      item: tuple[str, Any], chunk: Callable[[str, str | None], dict[str, Any]],
                      usage_chunk: Callable[[Finished], dict[str, Any] | None],
                      first: dict[str, Any] | None) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield _sse(first)
            while True:
                kind, value = item
                if kind == "text":
                    if value:
                        yield _sse(chunk(value, None))
                else:
                    exc = value.exception()
                    if exc is not None:
                        error = (_verifier_error(exc) if isinstance(exc, SpecDecError)
                                 else OpenAIError(500, f"internal error: {exc}"))
                        yield _sse(error.body())
                    else:
                        done: Finished = value.result()
                        last = chunk("", done.finish_reason)
                        last["specdec"] = done.result.metrics.to_dict()
                        yield _sse(last)
                        usage = usage_chunk(done)
                        if usage is not None:
                            yield _sse(usage)
                    break
                item = await queue.get()
            yield b"data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client that hung up stops the generation at its next block


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(prompt_tokens: int, done: Finished) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": prompt_tokens + done.completion_tokens}


def _json(payload: dict[str, Any], status: int = 200,
          headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json",
                    headers=headers)


# -- the app -------------------------------------------------------------------------------------

def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    gateway.authorize(request)
    return gateway


async def _parse(request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]
                 ) -> Any:
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            raise OpenAIError(400, f"the body is not valid JSON: {error['msg']}") from None
        param = ".".join(str(p) for p in error["loc"]) or None
        raise OpenAIError(400, f"{param}: {error['msg']}" if param else error["msg"],
                          param) from None


async def completions(request: Request) -> Response:
    gateway = _gateway(request)
    body: CompletionRequest = await _parse(request, CompletionRequest)
    job = gateway.completion_job(body)
    rid, created, name = f"cmpl-{secrets.token_hex(12)}", int(time.time()), body.model

    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish}]}

    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        events = await gateway.stream(job, chunk, lambda done: {
            **chunk("", None), "choices": [], "usage": _usage(len(job.prompt_ids), done),
        } if include else None)
        return StreamingResponse(events, media_type="text/event-stream")
    done = await gateway.run(job)
    payload = chunk(done.text, done.finish_reason)
    payload.update(usage=_usage(len(job.prompt_ids), done),
                   specdec=done.result.metrics.to_dict())
    return _json(payload)


async def chat_completions(request: Request) -> Response:
    gateway = _gateway(request)
    body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    job = gateway.chat_job(body)
    rid, created, name = f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), body.model

    def chunk(text: str, finish: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}]}

    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        first = chunk("", None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        events = await gateway.stream(job, chunk, lambda done: {
            **chunk("", None), "choices": [], "usage": _usage(len(job.prompt_ids), done),
        } if include else None, first)
        return StreamingResponse(events, media_type="text/event-stream")
    done = await gateway.run(job)
    return _json({
        "id": rid, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                     "logprobs": None, "finish_reason": done.finish_reason}],
        "usage": _usage(len(job.prompt_ids), done),
        "specdec": done.result.metrics.to_dict(),
    })


def _model_card(gateway: Gateway) -> dict[str, Any]:
    return {"id": gateway.settings.served_model_name, "object": "model", "created": 0,
            "owned_by": "specdec", "max_model_len": gateway.client.info.max_context}


async def list_models(request: Request) -> Response:
    return _json({"object": "list", "data": [_model_card(_gateway(request))]})


async def get_model(request: Request) -> Response:
    gateway = _gateway(request)
    gateway.check_model(request.path_params["model"])
    return _json(_model_card(gateway))


async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return _json({"status": "ok", "model": gateway.settings.served_model_name})


async def prometheus(request: Request) -> Response:
    return Response(generate_latest(_gateway(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    return _json(exc.body(), exc.status, headers)


async def _framework_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return _json(OpenAIError(exc.status_code, str(exc.detail)).body(), exc.status_code)


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in error["loc"] if p != "body") or None
    return _json(OpenAIError(400, str(error["msg"]), param).body(), 400)


def create_gateway(client: SpecDecClient, settings: GatewaySettings) -> FastAPI:
    gateway = Gateway(client, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            gateway.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdec gateway (OpenAI-compatible)", version="0.1.0",
                  lifespan=lifespan)
    app.state.gateway = gateway
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", get_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _framework_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(RequestMetrics, metrics=gateway.metrics.http,
                       routes=[(r.path_regex.pattern, r.path) for r in app.routes
                               if isinstance(r, APIRoute)])
    return app
