"""The OpenAI request bodies ``specdec serve`` accepts, and OpenAI's error shape.

Fields follow OpenAI's API reference for ``/v1/completions`` and ``/v1/chat/completions``;
``top_k`` is the common extension (vLLM, llama.cpp). Unknown fields are ignored, as vLLM does
(clients send ``user``, ``store``, ``metadata``, ``parallel_tool_calls`` and the like); known
fields that would change the distribution or the shape of the answer in ways we do not
implement (tools and the older ``functions``, ``echo``,
``suffix``, ``best_of``, audio output) get a 400 naming the field rather than being
silently dropped, until they are supported. ``n`` (up to :data:`MAX_CHOICES`), ``prediction``
(Predicted Outputs, chat), ``logprobs`` / ``top_logprobs``, the penalties, ``logit_bias`` and
``response_format`` (JSON object, JSON schema) are served.

Types are strict, as OpenAI's API and vLLM are: an integer is a JSON integer (not ``"5"``, not
``5.0``, not ``true``), a boolean is ``true`` / ``false``, a string is a string; numbers are finite
and within the ranges below (``max_tokens`` and ``top_k`` 31-bit, ``seed`` in [0, 2**63)).
``parse_request`` turns the first violation into a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_CHOICES = 16  # the most answers (``n``) one request may ask for
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's bound)
# Strict types, no NaN or infinity, unknown fields ignored: every request model's config.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class OpenAIError(Exception):
    """Rendered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "not_found_error", 408: "invalid_request_error",
             413: "invalid_request_error", 415: "invalid_request_error",
             421: "invalid_request_error", 429: "rate_limit_error", 502: "api_error",
             503: "api_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SpecdecOptions(BaseModel):
    """The request's ``specdec`` extension (the official client sends it in ``extra_body``);
    the playground uses it. Absent: the gateway's own settings, no per-block events."""

    model_config = STRICT
    # The k policy for this request: drafts per block (0: plain steps through a session) or
    # "auto" / "heuristic"; None: the gateway's --num-draft-tokens.
    k: Annotated[int, Field(ge=0, le=MAX_INT32)] | Literal["auto", "heuristic"] | None = None
    # The target alone (the verifier's /v1/generate, one call, no drafter): a race's reference.
    target_alone: bool = False
    # Each stream chunk carries the verified block it came from (``specdec_block``: k, accepted,
    # times, every token's text and kind); a plain answer carries them all (``specdec_blocks``).
    blocks: bool = False


class _Common(BaseModel):
    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # then capped by the context
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: OpenAI's default, 1
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # extension; 0 and -1 disable it
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # None: a fresh seed per request
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None  # completions: an int; chat: a bool
    user: str | None = None
    specdec: SpecdecOptions = Field(default_factory=SpecdecOptions)  # extension

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise OpenAIError(400, "at most 4 stop sequences", "stop")
        if any(not s for s in stops):
            raise OpenAIError(400, "stop sequences must not be empty", "stop")
        return stops

    def logprobs_asked(self) -> int | None:
        """Alternatives per token the request's logprobs ask for; None: no logprobs."""
        raise NotImplementedError

    def bias_pairs(self, vocab_size: int) -> list[tuple[int, float]]:
        """``logit_bias`` as [id, bias] pairs; a key that is not an id of the vocabulary is a
        400 naming the field."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:  # "²", "٣"
                raise OpenAIError(400, f"logit_bias: {key!r} is not a token id in [0, "
                                  f"{vocab_size})", "logit_bias")
            pairs.append((int(key), bias))
        return pairs

    def check_supported(self) -> None:
        """400 for a field we would otherwise have to ignore (each request kind's own)."""


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_INT32)

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the request asks for (0: the tokens' own
        log-probabilities alone); None: no logprobs."""
        if self.logprobs is None:
            return None
        if isinstance(self.logprobs, bool):
            raise OpenAIError(400, "logprobs: must be an integer (completions)", "logprobs")
        if not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(400, f"logprobs: must be in [0, {MAX_COMPLETION_LOGPROBS}]",
                              "logprobs")
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise OpenAIError(400, "echo is not supported", "echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, "only best_of=1 is supported", "best_of")

    def single_prompt(self) -> str | list[int]:
        """One prompt (text or token ids); a batch of several gets a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise OpenAIError(400, "one prompt per request (got a batch of "
                                  f"{len(prompt)}); send one request per prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise OpenAIError(400, "the prompt is empty", "prompt")
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    # Required: without tools, a message with no content (OpenAI allows null only next to
    # tool_calls) says nothing.
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class Prediction(BaseModel):
    """Predicted Outputs: text the answer will mostly repeat (an edited file), drafted from."""

    model_config = STRICT
    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT32)
    functions: list[Any] | None = None  # the older name of tools
    prediction: Prediction | None = None  # predicted outputs
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens  # the newer name wins
        return self

    def logprobs_asked(self) -> int | None:
        """``top_logprobs`` alternatives per token when ``logprobs`` is true; None: none."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise OpenAIError(400, "logprobs: must be a boolean (chat)", "logprobs")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise OpenAIError(400, "top_logprobs: needs logprobs to be true",
                                  "top_logprobs")
            if self.top_logprobs > MAX_TOP_LOGPROBS:
                raise OpenAIError(400, f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]",
                                  "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise OpenAIError(400, "tools are not supported", "tools")
        if self.functions:
            raise OpenAIError(400, "functions (tools) are not supported", "functions")
        if self.audio is not None or any(m != "text" for m in self.modalities or []):
            raise OpenAIError(400, "only text output is supported",
                              "audio" if self.audio is not None else "modalities")

    def output_schema(self) -> tuple[bool, dict[str, Any] | None]:
        """(constrained, schema) from ``response_format``: text (False, None), any JSON object
        (True, None) or a JSON schema (True, schema); anything else a 400 naming the field."""
        form = self.response_format or {"type": "text"}
        kind = form.get("type")
        if kind == "text":
            return False, None
        if kind == "json_object":
            return True, None
        if kind == "json_schema":
            spec = form.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise OpenAIError(400, "response_format.json_schema: must be an object with "
                                  "a name and a schema (an object)", "response_format")
            return True, spec.get("schema", {})
        raise OpenAIError(400, "response_format.type: must be \"text\", \"json_object\" or "
                          "\"json_schema\"", "response_format")

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# -- parsing -------------------------------------------------------------------------------------

Request = TypeVar("Request", CompletionRequest, ChatCompletionRequest)
# Field names of every request model: anything else in an error's location is a union member's
# tag ("str", "list[int]"), which names no field.
_FIELDS = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage,
                                        TextPart, StreamOptions, SpecdecOptions,
                                        Prediction)
                    for name in model.model_fields)
# What a field of several accepted shapes must be, said once instead of once per shape.
_SHAPES = {
    "prompt": "must be a string, a list of strings, a list of token ids (JSON integers) or a "
              "list of lists of token ids",
    "content": "must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "stop": "must be a string or a list of strings",
    "logprobs": "must be a boolean or an integer",
    "k": "must be an integer >= 0, \"auto\" or \"heuristic\"",
}


def parse_request(model: type[Request], raw: bytes) -> Request:
    """The validated request, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
    if error["type"] == "json_invalid":
        raise OpenAIError(400, f"the body is not valid JSON: {error['msg']}")
    if not error["loc"]:
        raise OpenAIError(400, f"the request body: {error['msg']}")
    union = any(isinstance(part, str) and part not in _FIELDS for part in error["loc"])
    path = [str(part) for part in error["loc"] if not isinstance(part, str) or part in _FIELDS]
    if union:  # cut after the last field name: the shapes are the field's, not an item's
        last = max(i for i, part in enumerate(path) if part in _FIELDS)
        path = path[:last + 1]
    param = ".".join(path)
    message = _SHAPES.get(path[-1]) if union else None
    raise OpenAIError(400, f"{param}: {message or error['msg']}", param)
