"""Verifier settings: the one source of every option.

Read from ``SPECDEC_*`` environment variables; ``specdec-verifier`` builds its command line from
the same fields (``--max-batch-size`` for ``max_batch_size``; booleans as ``--batching`` /
``--no-batching``), and flags win over the environment. ``docs/configuration.md`` lists them,
and a test checks that table against this class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSuppress, SettingsConfigDict

from shared.engines import DEFAULT_KV_BUDGET, ENGINES, MIN_CONTEXT, backends, option_models
from shared.http.limits import HTTP_LIMITS

if TYPE_CHECKING:
    from shared.engines.target import Engine, TargetOptions


def _engine_help() -> str:
    said = "; ".join(f"{b.name}: {b.summary}" for b in backends())
    return (f"what runs the target: {said}; auto: the first of these, in this order, that "
            "claims the model, or the one whose own options are set (e.g. --device-map), or "
            "where two can serve it the one whose measured costs serve the expected work "
            "fastest")


class CommonSettings(BaseSettings):
    """The settings every engine shares; :data:`Settings` adds each engine's own options."""

    model_config = SettingsConfigDict(
        env_prefix="SPECDEC_", extra="ignore", cli_prog_name="specdec-verifier",
        cli_kebab_case=True, cli_implicit_flags="dual", cli_avoid_json=True,
        cli_exit_on_error=True,
    )

    model: str = Field("qwen2.5-coder-1.5b", description="the target: short name of the "
                       "offline pair, local folder, .gguf file or hub id")
    engine: str = Field("auto", description=_engine_help())
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    threads: int = Field(0, ge=0, description="the engine's CPU threads (torch intra-op, or "
                         "llama.cpp's); 0: torch's default, or for llama.cpp "
                         "`OMP_NUM_THREADS` where set, else every core it may use")
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")

    max_sessions: int = Field(64, ge=1, description="LRU-evicts the least recently used beyond")
    session_ttl_s: float = Field(600.0, gt=0, description="idle sessions older than this expire")
    session_protect_s: float = Field(2.0, ge=0, description="a session is safe from eviction "
                                     "for this long after its last call (longer for a slow "
                                     "client: 4 x its mean interval between calls); a create "
                                     "that finds every slot so protected gets 503 + Retry-After")
    max_draft_tokens: int = Field(16, ge=0, description="largest k a verify call may send")
    max_context: int = Field(4096, ge=0, description="tokens one session may hold; "
                             "0: the model's max_position_embeddings")
    kv_budget_tokens: int = Field(0, ge=0, description="KV pool size in tokens, shared by the "
                                  "sessions (each holds a region of 256, 512, ... up to "
                                  "max_context tokens, grown as it needs); when it is full the "
                                  "least recently used idle session is evicted; 0: on CUDA what "
                                  "kv_memory_fraction of the device leaves free after the "
                                  f"model, elsewhere {DEFAULT_KV_BUDGET}")
    batching: bool = Field(True, description="batch concurrent calls into one forward pass")
    max_batch_size: int = Field(16, ge=1, description="jobs per batched forward")
    max_batch_tokens: int = Field(2048, ge=1, description="tokens per batched forward")
    batch_wait_ms: float = Field(10.0, ge=0, description="how long a batch may wait for "
                                 "sessions active in the last second that are not in it yet "
                                 "(not for one whose last call failed: most often it is gone)")
    max_queue: int = Field(256, ge=1, description="queued jobs; beyond it 429 + Retry-After")
    acceptance: Literal["device", "host"] = Field(
        "device", description="device: decide every verify block of a batch in one vectorised "
        "step next to the logits; host: copy each block's rows to the host (the reference)")
    max_new_tokens: int = Field(1024, ge=1, description="cap for /v1/generate")
    max_prompt_tokens: int = Field(0, ge=0, description="longest prompt; 0: max_context - 1")
    replica_name: str = Field("", description="sent as X-Verifier-Replica; default host:port")

    # Environment only (SPECDEC_API_KEYS): a flag would show the keys in `ps`.
    api_keys: CliSuppress[str] = Field(
        "", repr=False, description="comma-separated API keys; empty: no auth. Clients send "
        "one as 'Authorization: Bearer KEY' (or X-API-Key); /healthz and /readyz stay open")
    max_sessions_per_key: int = Field(0, ge=0, description="open sessions one API key may "
                                      "hold (0: only max_sessions applies); beyond it 429")
    max_body_bytes: int = Field(
        HTTP_LIMITS.max_body_bytes, ge=1024, description="largest request body; "
        "beyond it 413")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM: stop accepting, "
                                    "let calls in flight finish for up to this long, then exit")
    max_connections: int = Field(512, ge=1, description="open connections; a new one beyond "
                                 "it closes the one that waited longest for a request head "
                                 "(503 when all are busy)")
    header_timeout_s: float = Field(
        HTTP_LIMITS.header_timeout_s, gt=0, description="a connection must send a "
        "complete request head within this long of connecting or of "
        "its last response; else 408 and closed")
    body_timeout_s: float = Field(
        HTTP_LIMITS.body_timeout_s, gt=0, description="a request body must arrive within "
        "this long; else 408 and closed")
    http_parser: Literal["auto", "httptools", "h11"] = Field(
        "auto", description="the HTTP/1.1 parser: httptools (C) where installed, else h11")
    keep_alive_s: float = Field(
        HTTP_LIMITS.keep_alive_s, gt=0, description="an idle keep-alive connection is "
        "closed after this long")

    def key_list(self) -> list[str]:
        return [key.strip() for key in self.api_keys.split(",") if key.strip()]

    @field_validator("max_context", "kv_budget_tokens")
    @classmethod
    def _room_for_a_session(cls, tokens: int) -> int:
        if 0 < tokens < MIN_CONTEXT:
            raise ValueError(f"must be 0 or at least {MIN_CONTEXT} (a session's tokens: each "
                             f"start writes 16 into one and times verify blocks after them); "
                             f"got {tokens}")
        return tokens

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
        return engine

    def target_options(self) -> TargetOptions:
        """What every engine loads the target with (its own options apart: engine_options)."""
        from shared.engines.target import TargetOptions

        return TargetOptions(
            model=self.model, device=self.device, max_context=self.max_context,
            kv_budget_tokens=self.kv_budget_tokens, threads=self.threads,
            acceptance=self.acceptance, max_batch_tokens=self.max_batch_tokens,
            max_batch_size=self.max_batch_size if self.batching else 1,
            max_draft_tokens=self.max_draft_tokens)

    def engine_options(self) -> dict[str, Any]:
        """Each engine's own options (and auto's), from these settings' fields."""
        return {owner: model(**{name: getattr(self, name) for name in model.model_fields})
                for owner, model in option_models().items()}

    @model_validator(mode="after")
    def _consistent(self) -> CommonSettings:
        from shared.engines import check

        if self.max_context and self.max_prompt_tokens >= self.max_context:
            raise ValueError(f"max_prompt_tokens {self.max_prompt_tokens} must be below "
                             f"max_context {self.max_context} (the prompt and at least one "
                             "new token share one KV slot)")
        check(self.engine, self.target_options(), self.engine_options())
        return self


def _with_engine_options() -> type[CommonSettings]:
    """The verifier's settings: the common fields, then each engine's options (their flags and
    ``SPECDEC_*`` variables come from the engines' own models)."""
    fields: dict[str, Any] = {}
    for owner, model in option_models().items():
        for name, info in model.model_fields.items():
            if name in fields or name in CommonSettings.model_fields:
                raise AssertionError(f"the {owner} engine's option {name} is taken")
            fields[name] = (info.annotation, info)
    return create_model("Settings", __base__=CommonSettings, __module__=__name__,
                        __doc__="The verifier's settings: every option, each written once.",
                        **fields)


if TYPE_CHECKING:
    Settings = CommonSettings  # what the verifier reads; engines read their own options
else:
    Settings = _with_engine_options()


class SettingsError(ValueError):
    """A setting that does not fit the loaded model; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"--{field.replace('_', '-')} (SPECDEC_{field.upper()}): {message}")
        self.field = field


def load_engine(settings: CommonSettings) -> Engine:
    """The target of ``settings``, on the engine they resolve to (``shared/engines``), loaded,
    warmed up and ready to serve."""
    from shared.engines import load_target

    return load_target(settings.engine, settings.target_options(), settings.engine_options())


def check_against_model(settings: CommonSettings, max_context: int, model_limit: int) -> None:
    """Refuse settings the loaded model cannot honour (``max_context``: the effective one)."""
    if settings.max_prompt_tokens and settings.max_prompt_tokens >= max_context:
        raise SettingsError("max_prompt_tokens", f"{settings.max_prompt_tokens} must be below "
                            f"the context of {max_context} tokens per session (the model's "
                            f"limit is {model_limit})")


def settings_table() -> str:
    """The Markdown table of every setting (docs/configuration.md holds this exact text)."""
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        env = f"`SPECDEC_{name.upper()}`"
        if name == "api_keys":
            flag = "(environment only)"
        elif field.annotation is bool:
            flag = f"`--{name.replace('_', '-')}` / `--no-{name.replace('_', '-')}`"
        else:
            flag = f"`--{name.replace('_', '-')}`"
        default = "empty" if field.default == "" else f"`{field.default}`"
        lines.append(f"| {flag} | {env} | {default} | {field.description or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(settings_table())
