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

Closed to other sites by default (``shared/http/cross_site.py``): JSON bodies only (else 415),
a Host check against DNS rebinding (else 421), CORS headers only for the origins configured.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response, StreamingResponse

from drafter_client.api import SpecDecClient
from drafter_client.gateway.engine import (
    Chunk,
    ClientGone,
    Finished,
    Gateway,
    GatewaySettings,
    Job,
)
from drafter_client.gateway.playground import add_playground
from drafter_client.gateway.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_request,
)
from drafter_client.outcome import TokenLogprob
from shared.http.body_limit import BodyLimit
from shared.http.connections import disconnected, guarded_protocol
from shared.http.cross_site import HostCheck, HostPolicy, json_body_problem
from shared.http.metrics import RequestMetrics

__all__ = ["Gateway", "GatewaySettings", "create_gateway", "server_options"]


def _usage(prompt_tokens: int, done: list[Finished]) -> dict[str, Any]:
    """OpenAI's usage: the prompt once, every choice's tokens; with a prediction, its drafted
    tokens the target accepted and rejected (``drafter_client/prediction.py``)."""
    completion = sum(d.completion_tokens for d in done)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                             "total_tokens": prompt_tokens + completion}
    counts = [d.result.prediction for d in done if d.result.prediction is not None]
    if counts:
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(c.accepted for c in counts),
            "rejected_prediction_tokens": sum(c.rejected for c in counts)}
    return usage


def _with_blocks(payload: dict[str, Any], done: list[Finished]) -> dict[str, Any]:
    """A plain answer with its blocks' events when the request asked (``specdec.blocks``):
    one list per choice when it asked for several."""
    if done[0].blocks is not None:
        payload["specdec_blocks"] = (done[0].blocks if len(done) == 1
                                     else [d.blocks for d in done])
    return payload


def _metrics(done: list[Finished]) -> dict[str, Any] | list[dict[str, Any]]:
    """The speculative metrics: one choice's, or a list of every choice's."""
    metrics = [d.result.metrics.to_dict() for d in done]
    return metrics[0] if len(metrics) == 1 else metrics


LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -inf


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class _TokenTexts:
    """Each token's own text, as logprobs name tokens: what it adds to the text after the
    token before it (a tokenizer may put the space between words in neither token), one decode
    per (token before, token), remembered. One per response; ``after[i]``: choice i's last
    token so far (streamed logprobs continue where the last chunk ended)."""

    def __init__(self, gateway: Gateway) -> None:
        self.decode = gateway.client.decode
        self.seen: dict[tuple[int | None, int], str] = {}
        self.after: dict[int, int] = {}

    def text(self, before: int | None, token: int) -> str:
        key = (before, token)
        if key not in self.seen:
            if before is None:
                self.seen[key] = self.decode([token])
            else:
                head, both = self.decode([before]), self.decode([before, token])
                self.seen[key] = (both[len(head):] if both.startswith(head)
                                  else self.decode([token]))
        return self.seen[key]

    def of(self, index: int, entries: list[TokenLogprob]
           ) -> list[tuple[str, TokenLogprob, list[tuple[str, float]]]]:
        """(text, entry, [(alternative's text, log-probability)]) of choice ``index``'s next
        tokens."""
        out = []
        for entry in entries:
            before = self.after.get(index)
            out.append((self.text(before, entry.token), entry,
                        [(self.text(before, i), v) for i, v in entry.top]))
            self.after[index] = entry.token
        return out


def _chat_logprobs(texts: _TokenTexts, index: int, entries: list[TokenLogprob] | None
                   ) -> dict[str, Any] | None:
    """Chat's ``choices[i].logprobs``: every token with its bytes and its best alternatives."""
    if entries is None:
        return None

    def item(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode())}

    return {"content": [{**item(text, entry.logprob),
                         "top_logprobs": [item(t, v) for t, v in top]}
                        for text, entry, top in texts.of(index, entries)],
            "refusal": None}


def _completion_logprobs(texts: _TokenTexts, index: int, entries: list[TokenLogprob] | None,
                         offset: int = 0) -> dict[str, Any] | None:
    """Completions' ``choices[i].logprobs``: tokens, their log-probabilities, the best
    alternatives as {text: log-probability}, and where each token starts in the text (from
    ``offset``, the characters before it)."""
    if entries is None:
        return None
    rendered = texts.of(index, entries)
    tokens = [text for text, _, _ in rendered]
    offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens,
            "token_logprobs": [_logprob(entry.logprob) for _, entry, _ in rendered],
            "top_logprobs": [{t: _logprob(v) for t, v in top} for _, _, top in rendered],
            "text_offset": offsets}


def _json(payload: dict[str, Any], status: int = 200,
          headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json",
                    headers=headers)


# -- the app -------------------------------------------------------------------------------------

def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    gateway.authorize(request)
    return gateway


def _hang_up(request: Request) -> Callable[[], Awaitable[None]]:
    """Waits until the client hangs up (the body is read by then: what arrives next on the
    connection is its end)."""

    return lambda: disconnected(request)


async def _json_body(request: Request) -> bytes:
    """The POST body, if it is JSON: any other Content-Type (a form, ``text/plain``: what a page
    on another site can send without asking) gets 415 before it is parsed."""
    problem = json_body_problem(request.headers.get("content-type"))
    if problem is not None:
        raise OpenAIError(415, problem, None, "unsupported_media_type")
    return await request.body()


async def _stream(request: Request, gateway: Gateway, jobs: list[Job],
                  body: CompletionRequest | ChatCompletionRequest, chunk: Chunk,
                  first: Callable[[int], dict[str, Any]] | None = None) -> Response:
    """The SSE answer; a usage chunk (no choices) at the end when the request asked for one."""
    include = body.stream_options is not None and body.stream_options.include_usage

    def usage(done: list[Finished]) -> dict[str, Any] | None:
        if not include:
            return None
        return {**chunk(0, "", None, None), "choices": [],
                "usage": _usage(len(jobs[0].prompt_ids), done)}

    events = await gateway.stream(jobs, chunk, usage, first, gone=_hang_up(request))
    return StreamingResponse(events, media_type="text/event-stream")


async def completions(request: Request) -> Response:
    gateway = _gateway(request)
    body = parse_request(CompletionRequest, await _json_body(request))
    jobs = gateway.choices(await gateway.prepare(body), body.n)
    rid, created, name = f"cmpl-{secrets.token_hex(12)}", int(time.time()), body.model
    text_of, sent = _TokenTexts(gateway), [0] * len(jobs)  # token text sent per choice

    def choice(index: int, text: str, finish: str | None,
               logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        rendered = _completion_logprobs(text_of, index, logprobs, sent[index])
        if rendered is not None:
            sent[index] += sum(map(len, rendered["tokens"]))
        return {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish}

    def chunk(index: int, text: str, finish: str | None,
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [choice(index, text, finish, logprobs)]}

    if body.stream:
        return await _stream(request, gateway, jobs, body, chunk)
    done = await gateway.run(jobs, gone=_hang_up(request))
    return _json(_with_blocks({
        "id": rid, "object": "text_completion", "created": created, "model": name,
        "choices": [choice(i, d.text, d.finish_reason, d.logprobs) for i, d in enumerate(done)],
        "usage": _usage(len(jobs[0].prompt_ids), done), "specdec": _metrics(done)}, done))


async def chat_completions(request: Request) -> Response:
    gateway = _gateway(request)
    body = parse_request(ChatCompletionRequest, await _json_body(request))
    jobs = gateway.choices(await gateway.prepare(body), body.n)
    rid, created, name = f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), body.model
    text_of = _TokenTexts(gateway)

    def chunk(index: int, text: str, finish: str | None,
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": index, "delta": delta,
                             "logprobs": _chat_logprobs(text_of, index, logprobs),
                             "finish_reason": finish}]}

    def first(index: int) -> dict[str, Any]:
        opening = chunk(index, "", None)
        opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return opening

    if body.stream:
        return await _stream(request, gateway, jobs, body, chunk, first)
    done = await gateway.run(jobs, gone=_hang_up(request))
    return _json(_with_blocks({
        "id": rid, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": d.text},
                     "logprobs": _chat_logprobs(text_of, i, d.logprobs),
                     "finish_reason": d.finish_reason}
                    for i, d in enumerate(done)],
        "usage": _usage(len(jobs[0].prompt_ids), done), "specdec": _metrics(done),
    }, done))


def _model_card(gateway: Gateway) -> dict[str, Any]:
    return {"id": gateway.settings.served_model_name, "object": "model", "created": 0,
            "owned_by": "specdec", "max_model_len": gateway.client.info.max_context}


async def list_models(request: Request) -> Response:
    return _json({"object": "list", "data": [_model_card(_gateway(request))]})


async def get_model(request: Request) -> Response:
    gateway = _gateway(request)
    gateway.check_model(request.path_params["model"])
    return _json(_model_card(gateway))


async def specdec_settings(request: Request) -> Response:
    """What this gateway runs and the defaults a request gets (the playground's form)."""
    gateway = _gateway(request)
    client, info = gateway.client, gateway.client.info
    sampling = client.settings.sampling
    return _json({
        "model": gateway.settings.served_model_name, "verifier_model": info.model,
        "drafter": client.settings.describe(client.drafter_name),
        "k": client.settings.num_draft_tokens, "max_draft_tokens": info.max_draft_tokens,
        "max_context": info.max_context, "kernels": info.kernels,
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                     "top_k": sampling.top_k, "max_tokens": sampling.max_new_tokens,
                     "seed": sampling.seed},
    })


async def health(request: Request) -> Response:
    """Open to probes; under --serve-api-key it names nothing (the model is in /v1/models)."""
    gateway: Gateway = request.app.state.gateway
    if gateway.settings.api_key is not None:
        return _json({"status": "ok"})
    return _json({"status": "ok", "model": gateway.settings.served_model_name})


async def openapi_document(request: Request) -> Response:
    """/openapi.json under --serve-api-key: the schema, to a caller with the key."""
    _gateway(request)
    return _json(request.app.openapi())


async def prometheus(request: Request) -> Response:
    return Response(generate_latest(_gateway(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    return _json(exc.body(), exc.status, headers)


async def _client_gone(_: Request, exc: Exception) -> Response:
    """Nobody reads it: 499 (nginx's "client closed request") for the access log and metrics."""
    return Response(status_code=499)


async def _framework_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return _json(OpenAIError(exc.status_code, str(exc.detail)).body(), exc.status_code)


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in error["loc"] if p != "body") or None
    return _json(OpenAIError(400, str(error["msg"]), param).body(), 400)


def _reject_body(status: int, code: str, message: str) -> Response:
    """The body limit's 413 / 408 in OpenAI's error shape."""
    return _json(OpenAIError(status, message, "body", code).body(), status)


def _reject_host(status: int, code: str, message: str) -> Response:
    """The Host check's 421 in OpenAI's error shape."""
    return _json(OpenAIError(status, message, None, code).body(), status)


def _body_schema(model: type[CompletionRequest] | type[ChatCompletionRequest]
                 ) -> dict[str, Any]:
    """An operation's OpenAPI request body: the JSON schema ``parse_request`` validates against
    (the routes read the raw body themselves, so FastAPI cannot infer it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _with_body_schemas(app: FastAPI, served_model_name: str) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` with the request models (and what they nest) among its components; the
    one model name this gateway serves is the only valid ``model``."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schema["properties"]["model"]["enum"] = [served_model_name]
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    return openapi


def create_gateway(client: SpecDecClient, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway's app over ``client``; ``settings``' empty model name: the verifier's."""
    settings = (settings or GatewaySettings()).serving(client.info.model)
    gateway = Gateway(client, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            gateway.executor.shutdown(wait=False, cancel_futures=True)
            gateway.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # Under an API key the interactive docs are off and the schema needs the key.
    keyed = settings.api_key is not None
    app = FastAPI(title="specdec gateway (OpenAI-compatible)", version="0.1.0",
                  lifespan=lifespan, docs_url=None if keyed else "/docs",
                  redoc_url=None if keyed else "/redoc",
                  openapi_url=None if keyed else "/openapi.json")
    app.state.gateway = gateway
    app.openapi = _with_body_schemas(app, settings.served_model_name)  # type: ignore[method-assign]
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      openapi_extra=_body_schema(CompletionRequest))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                      openapi_extra=_body_schema(ChatCompletionRequest))
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/specdec/settings", specdec_settings, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    add_playground(app)
    if keyed:
        app.add_api_route("/openapi.json", openapi_document, methods=["GET"],
                          include_in_schema=False)
    app.add_api_route("/metrics", prometheus, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _framework_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, reject=_reject_body,
                       timeout_s=settings.body_timeout_s, limit_name="--max-body-bytes",
                       timeout_name="--body-timeout-s")
    if settings.cors_origins:  # only where configured: no CORS header at all by default
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           allow_private_network=True, expose_headers=["Retry-After"])
    app.add_middleware(HostCheck, policy=HostPolicy(settings.host, settings.allowed_hosts),
                       reject=_reject_host, port=settings.port)
    app.add_middleware(RequestMetrics, metrics=gateway.metrics.http,
                       routes=[(r.path_regex.pattern, r.path) for r in app.routes
                               if isinstance(r, APIRoute)])
    return app


def _head_error_body(status: int, code: str, message: str) -> bytes:
    """The connection guard's 408 / 431 / 503 in OpenAI's error shape."""
    return orjson.dumps(OpenAIError(status, message, None, code).body())


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn's options for the gateway (``specdec serve`` and the tests use the same): a
    deadline for every request head, as the verifier has, and for idle keep-alive connections."""
    return {"http": guarded_protocol("auto", settings.header_timeout_s, 0, _head_error_body,
                                     "the gateway's header_timeout_s"),
            "timeout_keep_alive": settings.keep_alive_s}
